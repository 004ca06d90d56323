"""Prompt logprobs on a GPU (issue 52): the row kernel against its torch reference in bfloat16 at
Llama 3's vocabulary, and the last stage's rows from a step on a 1B-shaped shard against the same
logits through the reference; a sequence that did not ask keeps its decode graphs.

    python -m pytest tests/gpu/test_prompt_logprobs_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()

from strata.kernels.prompt_logprobs import logprob_rows, logprob_rows_reference  # noqa: E402
from strata.services.worker.runner import ModelRunner  # noqa: E402
from strata.services.worker.sampling import prompt_logprobs as worker_rows  # noqa: E402
from strata.v1 import engine_pb2  # noqa: E402
from tests.gpu_shards import llama_1b_like, random_bf16_shard  # noqa: E402


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_the_kernel_gives_the_references_rows_in_bfloat16(k):
    rows, vocab = 300, 128256
    g = torch.Generator(device="cuda").manual_seed(k)
    logits = (torch.randn(rows, vocab, device="cuda", generator=g) * 4).to(torch.bfloat16)
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    got, want = logprob_rows(logits, targets, k), logprob_rows_reference(logits, targets, k)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-4)
    assert torch.equal(got[1], want[1]) and torch.equal(got[2], want[2])
    assert torch.equal(got[3], want[3])  # the same values, largest first
    # The ids name those values (bfloat16 ties may order equal values differently).
    assert torch.equal(logits.gather(1, got[4]).float(), got[3])
    assert all(len(set(row)) == k for row in got[4].tolist())


def _runner(shard, config) -> ModelRunner:
    runner = ModelRunner(
        shard,
        config,
        stage_index=0,
        num_stages=1,
        block_size=16,
        max_model_len=512,
        device=torch.device("cuda"),
        dtype=torch.bfloat16,
        max_num_seqs=8,
        cuda_graph_max_batch=8,
    )
    runner.init_cache(8 * 32)
    return runner


def test_a_steps_rows_equal_the_reference_and_others_keep_their_graphs(monkeypatch):
    config = llama_1b_like(num_layers=2)
    shard = random_bf16_shard(config)
    gen = torch.Generator().manual_seed(3)
    asking, plain = (torch.randint(3, 8192, (n,), generator=gen).tolist() for n in (300, 40))
    k = 5

    def admit():
        return engine_pb2.StepPlan(
            step_id=1,
            new_sequences=[
                engine_pb2.NewSequence(
                    seq_id=1, sampling=engine_pb2.SamplingOptions(top_p=1.0, seed=1, logprobs=-1, prompt_logprobs=k)
                ),
                engine_pb2.NewSequence(seq_id=2, sampling=engine_pb2.SamplingOptions(top_p=1.0, seed=2, logprobs=-1)),
            ],
            seq_ids=[1, 2],
            num_computed=[0, 0],
            num_scheduled=[len(asking), len(plain)],
            input_token_ids=asking + plain,
            table_keep=[0, 0],
            table_append_counts=[20, 4],
            table_append_ids=list(range(24)),
            sample=[True, True],
            prompt_logprob_offsets=[0, 0],
            prompt_logprob_counts=[len(asking) - 1, 0],
            prompt_logprob_token_ids=asking[1:],
        )

    kernel = _runner(shard, config).execute(admit()).finish()
    monkeypatch.setattr(worker_rows, "fused", lambda device: False)  # the torch reference on the same GPU
    reference_runner = _runner(shard, config)
    reference = reference_runner.execute(admit()).finish()
    monkeypatch.undo()
    assert len(kernel.prompt_logprobs) == len(asking) - 1 and len(kernel.prompt_top_token_ids) == k * (len(asking) - 1)
    torch.testing.assert_close(
        torch.tensor(kernel.prompt_logprobs), torch.tensor(reference.prompt_logprobs), rtol=0, atol=1e-4
    )
    assert list(kernel.prompt_logprob_ranks) == list(reference.prompt_logprob_ranks)
    assert list(kernel.prompt_top_logprobs) == pytest.approx(list(reference.prompt_top_logprobs), abs=1e-4)
    assert list(kernel.token_ids) == list(reference.token_ids)
    # The next step asks nothing: both sequences decode on the decode graph, as they would have.
    decode = engine_pb2.StepPlan(
        step_id=2,
        seq_ids=[1, 2],
        num_computed=[len(asking), len(plain)],
        num_scheduled=[1, 1],
        input_token_ids=list(reference.token_ids),
        table_keep=[20, 4],
        table_append_counts=[0, 0],
        sample=[True, True],
    )
    reference_runner.execute(decode).finish()
    assert reference_runner.decode_graph_step is not None

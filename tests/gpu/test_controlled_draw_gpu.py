"""The controlled draw in the decode and verification graphs (issue 30's GPU path): rows under a
grammar or penalties, beside plain rows, get the tokens the general path (float32 copy of the
logits, penalties, bitmask, the Sampler) gives on the same graph logits, under decode lookahead
with steps launched ahead, and in verification graphs; nothing compiles after warm-up.

    python -m pytest tests/gpu/test_controlled_draw_gpu.py -q

Oracle: a second runner whose controlled steps take the general path (its can_draw answers
False); both replay the same graphs, so their logits are bit-identical.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()

from strata.protocol import PLACEHOLDER_TOKEN  # noqa: E402
from strata.services.worker.runner import ModelRunner  # noqa: E402
from strata.v1 import engine_pb2  # noqa: E402
from tests.gpu.test_runner_gpu import BLOCKS_PER_SEQ, _compiled_variants, _split, decode_plan  # noqa: E402
from tests.gpu_shards import llama_1b_like, random_bf16_shard  # noqa: E402

TOKENIZER = Path.home() / ".cache" / "strata" / "SmolLM2-135M-Instruct"
BLOCK_SIZE, MAX_SEQS = 16, 16
SCHEMA = json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 64})
JSON = dict(constraint_kind=engine_pb2.CONSTRAINT_KIND_JSON_SCHEMA, constraint=SCHEMA)
PENALTIES = dict(
    presence_penalty=0.6,
    frequency_penalty=0.4,
    repetition_penalty=1.3,
    logit_bias_token_ids=[5, 70, 49_500],
    logit_bias_values=[2.0, -1.5, 3.0],
)
# (temperature, seed, options) per sequence: plain, constrained, penalised and both, greedy and sampled.
ROWS = [
    (1.0, 11, {}),
    (0.0, 12, JSON),
    (1.0, 13, JSON),
    (0.0, 14, PENALTIES),
    (0.8, 15, PENALTIES),
    (0.0, 16, {}),
    (1.2, 17, {**JSON, **PENALTIES}),
    (0.0, 18, {**JSON, **PENALTIES}),
]

needs_tokenizer = pytest.mark.skipif(not TOKENIZER.exists(), reason="needs the default model's tokenizer")


@pytest.fixture(scope="module")
def shard_and_config():
    # A vocabulary larger than the tokenizer's (49,152): the ids past it are forbidden under a grammar.
    config = dataclasses.replace(llama_1b_like(num_layers=2), vocab_size=50_000)
    return random_bf16_shard(config), config


def new_runner(shard, config, general: bool = False, k: int = 0) -> ModelRunner:
    runner = ModelRunner(
        shard,
        config,
        stage_index=0,
        num_stages=1,
        block_size=BLOCK_SIZE,
        max_model_len=BLOCK_SIZE * BLOCKS_PER_SEQ,
        device=torch.device("cuda"),
        dtype=torch.bfloat16,
        max_num_seqs=MAX_SEQS,
        cuda_graph_max_batch=MAX_SEQS,
        num_speculative_tokens=k,
        speculative_max_batch=MAX_SEQS if k else 0,
        tokenizer_dir=str(TOKENIZER),
    )
    runner.init_cache(MAX_SEQS * BLOCKS_PER_SEQ)
    if general:
        runner.controls.can_draw = lambda token_rows: False
    return runner


def admit(prompts) -> engine_pb2.StepPlan:
    seq_ids = list(range(1, len(prompts) + 1))
    return engine_pb2.StepPlan(
        step_id=1,
        new_sequences=[
            engine_pb2.NewSequence(
                seq_id=s,
                sampling=engine_pb2.SamplingOptions(temperature=t, top_p=1.0, seed=seed, logprobs=-1, **options),
                num_prompt_tokens=len(p),
                history_start=0,
                history_token_ids=p,
            )
            for s, p, (t, seed, options) in zip(seq_ids, prompts, ROWS)
        ],
        seq_ids=seq_ids,
        num_computed=[0] * len(prompts),
        num_scheduled=[len(p) for p in prompts],
        input_token_ids=[t for p in prompts for t in p],
        table_keep=[0] * len(prompts),
        table_append_counts=[BLOCKS_PER_SEQ] * len(prompts),
        table_append_ids=[(s - 1) * BLOCKS_PER_SEQ + b for s in seq_ids for b in range(BLOCKS_PER_SEQ)],
        sample=[True] * len(prompts),
    )


def verify(step_id: int, lengths: list[int], last: list[int], drafts: list[list[int]]) -> engine_pb2.StepPlan:
    n = len(lengths)
    return engine_pb2.StepPlan(
        step_id=step_id,
        seq_ids=list(range(1, n + 1)),
        num_computed=lengths,
        num_scheduled=[1 + len(d) for d in drafts],
        input_token_ids=[t for x, d in zip(last, drafts) for t in [x, *d]],
        table_keep=[BLOCKS_PER_SEQ] * n,
        table_append_counts=[0] * n,
        sample=[True] * n,
        num_draft_tokens=[len(d) for d in drafts],
    )


def prompts_for(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # Repeated tokens (the penalties see them) and ids past the tokenizer's vocabulary.
    return [
        torch.randint(3, 50_000, (int(n),), generator=gen).tolist() + [5, 70, 5]
        for n in torch.randint(5, 30, (len(ROWS),), generator=gen)
    ]


@needs_tokenizer
def test_controlled_rows_draw_the_general_paths_tokens_in_decode_graphs(shard_and_config):
    shard, config = shard_and_config
    fused, general = new_runner(shard, config), new_runner(shard, config, general=True)
    before = _compiled_variants()
    prompts = prompts_for(1)
    first = list(fused.execute(admit(prompts)).finish().token_ids)
    assert list(general.execute(admit(prompts)).finish().token_ids) == first
    lengths = [len(p) for p in prompts]
    out = [[t] for t in first]
    # fused runs as the worker does under decode lookahead: placeholders, each step launched
    # before the previous step's tokens reached the host.
    n = len(ROWS)
    pending = fused.execute(decode_plan(2, lengths, [PLACEHOLDER_TOKEN] * n))
    for step in range(3, 19):
        launched = fused.execute(decode_plan(step, [x + 1 for x in lengths], [PLACEHOLDER_TOKEN] * n))
        got = list(pending.finish().token_ids)
        want = list(general.execute(decode_plan(step - 1, lengths, [o[-1] for o in out])).finish().token_ids)
        assert got == want, f"step {step - 1}: {got} != {want}"
        for o, t in zip(out, got):
            o.append(t)
        lengths = [x + 1 for x in lengths]
        pending = launched
    pending.finish()
    assert _compiled_variants() == before, "a kernel compiled after warm-up"
    # Constrained rows wrote JSON: an array of integers; plain rows wrote anything.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    for (_, _, options), o in zip(ROWS, out):
        if "constraint" in options:
            text = tok.decode(o)
            body = text.lstrip()
            assert body.startswith("[") and set(body[1:]) <= set("0123456789-, "), text
            assert max(o) < 49_152
    assert len({tuple(o) for o in out}) == n


@needs_tokenizer
def test_controlled_rows_in_verification_graphs(shard_and_config):
    """Drafts equal to the plain decode's tokens are accepted, a wrong one is cut, under the
    grammar and the penalties (drafts count before later verify rows), as the general path does."""
    shard, config = shard_and_config
    k = 3
    plain = new_runner(shard, config)
    fused, general = new_runner(shard, config, k=k), new_runner(shard, config, general=True, k=k)
    assert sorted(fused.verify_graphs) == [2, 3, 4]
    prompts = prompts_for(2)
    first = list(plain.execute(admit(prompts)).finish().token_ids)
    for runner in (fused, general):
        assert list(runner.execute(admit(prompts)).finish().token_ids) == first
    lengths, out = [len(p) for p in prompts], [[t] for t in first]
    for step in range(2, 2 + 2 * k):
        step_out = plain.execute(
            decode_plan(step, [x + len(o) - 1 for x, o in zip(lengths, out)], [o[-1] for o in out])
        ).finish()
        for o, t in zip(out, step_out.token_ids):
            o.append(t)
    drafts = [o[1 : 1 + k] for o in out]
    drafts[2] = drafts[2][:1] + [(drafts[2][1] + 1) % 49_000] + drafts[2][2:]
    plan = verify(10, lengths, [o[0] for o in out], drafts)
    got = _split(fused.execute(plan).finish())
    assert got == _split(general.execute(plan).finish())
    agree = sum(e == o[1 : 1 + len(e)] for e, o in zip(got, out))
    assert len(got[2]) <= 2 and agree >= len(ROWS) - 2, (got, out)


@pytest.mark.parametrize("rows", [8, 192])  # both launch shapes
def test_controlled_draw_kernel_equals_the_sampler_on_the_controlled_logits(rows):
    """The compiled kernel at the 1B vocabulary: a patch (penalised values, their tokens -inf in
    the logits) and a bitmask per row give the sampler kernel's tokens on the float32 logits
    with the patch written in and the mask applied, greedy and sampled rows alike."""
    from strata.kernels.controlled_sampling import apply_bitmask_, controlled_draw
    from strata.kernels.gumbel_sampling import gumbel_argmax

    V, mask_vocab, width = 128_256, 128_000, 600
    gen = torch.Generator(device="cuda").manual_seed(rows)
    logits = (torch.randn(rows, V, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    logits[:, 1000:1008] = 9.0  # greedy ties
    n = rows - 2  # two rows left to the graph's draw
    sel = torch.arange(1, n + 1, device="cuda")
    # Distinct tokens per row (a penalised token seen twice has one value, written twice).
    patch_tok = torch.rand(n, V, device="cuda", generator=gen).argsort(dim=1)[:, :width].to(torch.int32)
    patch_tok[:, 0] = torch.where((patch_tok[:, 1:] == 1003).any(dim=1), patch_tok[:, 0], 1003)  # ties
    patch_tok[:, -50:] = -1
    patch_val = torch.randn(n, width, device="cuda", generator=gen) * 4
    patch_index = torch.where(torch.arange(n, device="cuda") % 3 == 0, -1, torch.arange(n, device="cuda"))
    words = (mask_vocab + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (n, words), device="cuda", generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    mask_index = torch.where(torch.arange(n, device="cuda") % 4 == 1, -1, torch.arange(n, device="cuda"))
    seeds = torch.randint(-(2**62), 2**62, (rows,), device="cuda", generator=gen)
    positions = torch.randint(0, 2**30, (rows,), device="cuda", generator=gen)
    inv_t = torch.rand(rows, device="cuda", generator=gen) + 0.5
    greedy = (torch.arange(rows, device="cuda") % 5 == 0).to(torch.uint8)
    keys = (seeds, positions, inv_t, greedy)

    dense = logits.float()
    for i in range(n):  # the patch written into the float32 copy (the general path's penalties)
        p = int(patch_index[i])
        if p >= 0:
            keep = patch_tok[p] >= 0
            dense[i + 1, patch_tok[p][keep].long()] = patch_val[p][keep]
    masked = mask_index >= 0
    apply_bitmask_(dense, bitmask[mask_index[masked]], sel[masked], mask_vocab)
    want = gumbel_argmax(dense, *keys, None, False)[0]

    src = logits.clone()
    for i in range(n):
        p = int(patch_index[i])
        if p >= 0:
            keep = patch_tok[p] >= 0
            src[i + 1, patch_tok[p][keep].long()] = float("-inf")
    tokens = torch.full((rows,), -1, dtype=torch.int64, device="cuda")
    controlled_draw(
        src,
        sel,
        *keys,
        tokens,
        mask=(bitmask, mask_index.to(torch.int32), mask_vocab),
        patch=(patch_tok, patch_val, patch_index.to(torch.int32)),
    )
    assert torch.equal(tokens[1 : n + 1], want[1 : n + 1])
    assert tokens[0] == -1 and tokens[-1] == -1

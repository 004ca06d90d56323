"""Speculative verification on the last stage: which draws are emitted, and how often a draft
model coupled through the same (seed, position) noise proposes the target's own draw."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strata.services.worker.sampling.sampler import Sampler, SamplingTensors
from strata.services.worker.speculation.verification import Verification, accepted_rows
from tests.tiny_models import cpu_runner


def test_drafts_are_accepted_left_to_right_and_the_next_draw_is_emitted():
    # Three sequences: 3 drafts (2 right), 1 draft (right: the bonus draw follows), no drafts.
    verify = Verification(rows_per_seq=np.array([4, 2, 1]), drafts=np.array([10, 11, 12, -1, 20, -1, -1]))
    tokens = np.array([10, 11, 99, 13, 20, 21, 30])
    num_tokens, rows = accepted_rows(tokens, verify)
    assert num_tokens.tolist() == [3, 2, 1]
    assert tokens[rows].tolist() == [10, 11, 99, 20, 21, 30]
    # A mismatch at the first draft emits only the target's draw there.
    num_tokens, rows = accepted_rows(np.array([7, 11, 12, 13]), Verification(np.array([4]), np.array([10, 11, 12, -1])))
    assert num_tokens.tolist() == [1] and rows.tolist() == [0]


def _draws(logits: torch.Tensor, temperature: float, seeds: np.ndarray, position: int, **filters) -> np.ndarray:
    n = len(seeds)
    st = SamplingTensors.build(
        temperature=[temperature] * n,
        top_k=[filters.get("top_k", 0)] * n,
        top_p=[filters.get("top_p", 1.0)] * n,
        min_p=[0.0] * n,
        seeds=seeds,
        positions=[position] * n,
        num_logprobs=-1,
        device="cpu",
    )
    return Sampler("torch")(logits.expand(n, -1).contiguous(), st).token_ids.numpy()


@pytest.mark.parametrize("temperature, filters", [(1.0, {}), (0.8, {"top_p": 0.9})])
def test_coupled_draft_acceptance_against_the_rejection_sampling_optimum(temperature, filters):
    """Target p and draft q on the same logits shape; each (seed, position) draws both with the
    same Gumbel noise. Rejection sampling accepts with probability 1 - TV(p, q), the most any
    scheme keeping p's distribution can; the coupled draw keeps the target's *tokens* and reaches
    at least (1 - TV) / (1 + TV), the Gumbel-max coupling's guarantee."""
    g = torch.Generator().manual_seed(0)
    vocab = 64
    target = torch.randn(vocab, generator=g) * 2.0
    for noise in (0.3, 1.0, 3.0):  # drafts from close to far
        draft = target + torch.randn(vocab, generator=g) * noise
        seeds = np.arange(20000, dtype=np.int64) * 7919 + 13
        t_draws = _draws(target[None], temperature, seeds, 5, **filters)
        d_draws = _draws(draft[None], temperature, seeds, 5, **filters)
        acceptance = float((t_draws == d_draws).mean())
        p = _distribution(target, temperature, filters)
        q = _distribution(draft, temperature, filters)
        tv = 0.5 * float((p - q).abs().sum())
        # The target's draws follow p (the coupling changes nothing about them).
        empirical = np.bincount(t_draws, minlength=vocab) / len(seeds)
        assert 0.5 * np.abs(empirical - p.numpy()).sum() < 0.03
        print(f"noise {noise}: coupled acceptance {acceptance:.3f}, optimum 1 - TV {1 - tv:.3f}")
        assert (1 - tv) / (1 + tv) - 0.02 <= acceptance <= 1 - tv + 0.02


def _distribution(logits: torch.Tensor, temperature: float, filters: dict) -> torch.Tensor:
    """The sampler's distribution: softmax(logits / T) over the kept tokens."""
    scaled = logits / temperature
    probs = torch.softmax(scaled, dim=-1)
    top_p = filters.get("top_p", 1.0)
    if top_p < 1.0:
        order = probs.argsort(descending=True)
        before = probs[order].cumsum(0) - probs[order]
        kept = torch.zeros_like(probs, dtype=torch.bool)
        kept[order[before < top_p]] = True
        probs = torch.where(kept, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs


def test_a_padded_verification_step_computes_what_the_unpadded_one_does(tmp_path):
    """Mixed draft counts run on a verification graph of one query length by padding each
    sequence (pad_queries): its real rows must not change. Checked on CPU through the eager path
    with the padded inputs."""
    from strata.services.worker.model.weights import load_shard
    from strata.v1 import engine_pb2
    from tests.tiny_models import write_tiny_model

    model = write_tiny_model(tmp_path / "m", seed=3)
    shard, config = load_shard(model, 0, 1, torch.float32, "cpu")
    plain, padded = cpu_runner(shard, config), cpu_runner(shard, config)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10]]
    admit = engine_pb2.StepPlan(
        step_id=1,
        seq_ids=[1, 2, 3],
        num_computed=[0, 0, 0],
        num_scheduled=[len(p) for p in prompts],
        input_token_ids=[t for p in prompts for t in p],
        table_keep=[0, 0, 0],
        table_append_counts=[4, 4, 4],
        table_append_ids=list(range(12)),
        sample=[True] * 3,
        new_sequences=[
            engine_pb2.NewSequence(
                seq_id=s, sampling=engine_pb2.SamplingOptions(temperature=t, top_p=1.0, seed=s, logprobs=-1)
            )
            for s, t in ((1, 0.0), (2, 0.9), (3, 0.0))
        ],
    )
    first = plain.execute(admit).finish()
    assert padded.execute(admit).finish().token_ids == first.token_ids
    drafts = [[7, 7, 7], [], [1]]  # mixed: 3 drafts, none, 1
    verify = engine_pb2.StepPlan(
        step_id=2,
        seq_ids=[1, 2, 3],
        num_computed=[len(p) for p in prompts],
        num_scheduled=[1 + len(d) for d in drafts],
        input_token_ids=[t for last, d in zip(first.token_ids, drafts) for t in [last, *d]],
        table_keep=[4, 4, 4],
        table_append_counts=[0, 0, 0],
        sample=[True] * 3,
        num_draft_tokens=[len(d) for d in drafts],
    )
    build = padded.inputs.build
    padded.inputs.build = lambda plan, rows, **kw: padded.inputs.pad_queries(build(plan, rows, **kw), 4)
    want, got = plain.execute(verify).finish(), padded.execute(verify).finish()
    assert (list(got.num_tokens), list(got.token_ids)) == (list(want.num_tokens), list(want.token_ids))
    assert len(got.token_ids) >= 3
    for cache_a, cache_b in zip(plain.kv_caches, padded.kv_caches):  # the pads wrote no KV
        torch.testing.assert_close(cache_a, cache_b, rtol=1e-5, atol=1e-5)

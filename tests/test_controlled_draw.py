"""SamplingControls.draw_controlled (the GPU's controlled draw, run here on CPU with the kernels'
torch references) against the general path (apply: a float32 copy with every control, then the
Sampler): the same tokens for rows under a grammar, penalties and both, greedy and sampled, over
decode steps whose tokens feed the next (matchers advance, counts grow), a verification step
(drafts counted before later rows, the grammar filled along the drafts), and decodes after it.
The tokenizer's vocabulary (49,152) is smaller than the model's here: the ids past it are
forbidden under a grammar on both paths."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from strata.services.worker.sampling.sampler import Sampler, SamplingTensors
from strata.services.worker.sampling.sampling_controls import SamplingControls
from strata.services.worker.speculation.verification import Verification
from strata.v1 import engine_pb2

TOKENIZER = Path.home() / ".cache" / "strata" / "SmolLM2-135M-Instruct"
V = 50_000
SCHEMA = json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 64})  # never ends here
JSON = dict(constraint_kind=engine_pb2.CONSTRAINT_KIND_JSON_SCHEMA, constraint=SCHEMA)
PEN = dict(
    presence_penalty=0.5,
    frequency_penalty=0.7,
    repetition_penalty=1.3,
    logit_bias_token_ids=[5, 49_999],
    logit_bias_values=[3.0, 2.0],
)
# (temperature, options) per row; row 3 is plain (the graph draws it, not the controls).
ROWS = [(1.0, PEN), (1.0, JSON), (0.7, {**JSON, **PEN}), (1.0, {}), (0.0, JSON), (0.0, PEN)]
PROMPT = [11, 3, 4, 11, 12, 3, 5, 5]


def _controls() -> SamplingControls:
    c = SamplingControls(16, V, 256, torch.device("cpu"), torch.zeros(17, dtype=torch.long), str(TOKENIZER), [2])
    for row, (t, options) in enumerate(ROWS):
        seq = engine_pb2.NewSequence(
            seq_id=row + 1,
            sampling=engine_pb2.SamplingOptions(temperature=t, top_p=1.0, seed=100 + row, logprobs=-1, **options),
            num_prompt_tokens=len(PROMPT),
            history_start=0,
            history_token_ids=PROMPT,
        )
        c.add(row, seq)
    return c


def _settings(h):
    rows = h.sample_rows
    temperature = np.asarray([ROWS[r][0] for r in rows], np.float32)
    st = SamplingTensors.build(
        temperature=temperature,
        top_k=[0] * len(rows),
        top_p=[1.0] * len(rows),
        min_p=[0.0] * len(rows),
        seeds=[100 + r for r in rows],
        positions=h.sample_positions,
        num_logprobs=-1,
        device="cpu",
    )
    return st, (st.seeds, st.positions, st.inv_temperature, st.greedy.to(torch.uint8))


def _decode_step(positions, tokens):
    rows = np.arange(len(ROWS))
    h = SimpleNamespace(
        token_rows=rows,
        positions=np.asarray(positions),
        query_start_loc=np.arange(len(ROWS) + 1),
        sample_rows=rows,
        sample_positions=np.asarray(positions) + 1,
        verify=None,
    )
    return engine_pb2.StepPlan(input_token_ids=tokens), h


def _verify_step(positions, tokens, drafts):
    """Row 0 verifies its drafts after its last token; the others decode one token."""
    token_rows = np.asarray([0] * (1 + len(drafts)) + list(range(1, len(ROWS))))
    pos = [positions[0] + j for j in range(1 + len(drafts))] + list(positions[1:])
    q = [1 + len(drafts)] + [1] * (len(ROWS) - 1)
    h = SimpleNamespace(
        token_rows=token_rows,
        positions=np.asarray(pos),
        query_start_loc=np.concatenate([[0], np.cumsum(q)]),
        sample_rows=token_rows,
        sample_positions=np.asarray(pos) + 1,
        verify=Verification(np.asarray(q), np.asarray(list(drafts) + [-1] * len(ROWS))),
    )
    plan = engine_pb2.StepPlan(
        input_token_ids=[tokens[0], *drafts, *tokens[1:]], num_draft_tokens=[len(drafts)] + [0] * (len(ROWS) - 1)
    )
    return plan, h


@pytest.mark.skipif(not TOKENIZER.exists(), reason="needs the default model's tokenizer")
@pytest.mark.parametrize("kinds", ["both", "penalties only", "grammar only"])
def test_controlled_draw_gives_the_general_paths_tokens(kinds, monkeypatch):
    if kinds != "both":  # steps without a bitmask, or without a patch: their stand-ins
        drop = "constraint" if kinds == "penalties only" else "presence_penalty"
        rows = [(t, {} if drop in options else options) for t, options in ROWS]
        monkeypatch.setattr(sys.modules[__name__], "ROWS", rows)
    general, fused = _controls(), _controls()
    assert bool(general.penalties.rows) == (kinds != "grammar only")
    assert bool(general.grammar.rows) == (kinds != "penalties only")
    assert general.drawable[: len(ROWS)].all() and not general.controlled[3]
    gen = torch.Generator().manual_seed(0)
    positions, tokens = [len(PROMPT) - 1] * len(ROWS), [PROMPT[-1]] * len(ROWS)
    out = [[] for _ in ROWS]
    for step in range(14):
        if step == 8:
            plan, h = _verify_step(positions, tokens, out[0][-6:-4])  # its tokens two steps back: not its next
        else:
            plan, h = _decode_step(positions, tokens)
        logits = torch.randn(len(h.sample_rows), V, generator=gen) * 4
        logits[:, 49_152:] += 10.0  # ids past the tokenizer's vocabulary would win where unmasked
        st, settings = _settings(h)

        general.begin_step(plan, h)
        controlled, grammar_rows = general.apply(logits.clone(), h)
        want = Sampler()(controlled, st).token_ids
        general.after_draw(h, want, grammar_rows)

        got = Sampler()(logits, st).token_ids.clone()  # the graph's draw of the plain rows
        plain = ~torch.from_numpy(fused.controlled[h.sample_rows])
        got[~plain] = -1
        fused.draw_controlled(plan, h, logits.clone(), got, settings, None, None)
        assert torch.equal(got, want), (step, got, want)

        if h.verify is not None:
            from strata.services.worker.speculation.verification import accepted_rows

            num, emitted = accepted_rows(want.numpy(), h.verify)
            firsts = np.cumsum(h.verify.rows_per_seq) - h.verify.rows_per_seq
            per_row = [want[emitted].tolist()[sum(num[:s]) : sum(num[: s + 1])] for s in range(len(num))]
            assert num[0] == 1  # the stale drafts were cut at the first
            positions = [p + n for p, n in zip([positions[0]] + list(positions[1:]), num)]
            tokens = [r[-1] for r in per_row]
            for o, r in zip(out, per_row):
                o.extend(r)
            assert firsts[0] == 0
        else:
            for o, t in zip(out, want.tolist()):
                o.append(t)
            positions = [p + 1 for p in positions]
            tokens = want.tolist()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TOKENIZER))
    for (_, options), o in zip(ROWS, out):
        if "constraint" in options:
            assert max(o) < 49_152 and tok.decode(o).lstrip().startswith("["), tok.decode(o)
        else:
            assert max(o) >= 49_152  # the bias and the shifted logits: unmasked rows do emit them
    for r in general.penalties.rows:
        slot = general.penalties.rows[r].slot
        assert torch.equal(general.penalties.counts[slot], fused.penalties.counts[fused.penalties.rows[r].slot])


@pytest.mark.skipif(not TOKENIZER.exists(), reason="needs the default model's tokenizer")
def test_a_worker_side_compile_failure_is_retried_then_fails_loudly(monkeypatch):
    """The gateway parsed the constraint, so the worker's compile failing is the worker's own
    fault (an import race, say): it is compiled once more, and if that fails too the step
    fails, never a row drawn unconstrained as if it had worked."""
    from strata.services.worker.sampling.grammar import GrammarCompilerPool, GrammarState

    pool = GrammarCompilerPool(str(TOKENIZER), V, [2])
    compile_grammar = pool._compile
    failures = iter([ImportError("cannot import name 'PreTrainedTokenizerBase'")])

    def flaky(kind, text):
        error = next(failures, None)
        if error is not None:
            raise error
        return compile_grammar(kind, text)

    monkeypatch.setattr(pool, "_compile", flaky)
    state = GrammarState(pool, 4, V, torch.device("cpu"))
    seq = engine_pb2.NewSequence(sampling=engine_pb2.SamplingOptions(**JSON))
    state.add(0, seq.sampling, len(PROMPT), len(PROMPT), [])
    assert state._matcher(state.rows[0]) is not None  # the second compile served it

    monkeypatch.setattr(pool, "_compile", lambda kind, text: (_ for _ in ()).throw(ImportError("again")))
    other = engine_pb2.SamplingOptions(constraint_kind=engine_pb2.CONSTRAINT_KIND_REGEX, constraint="[0-9]+")
    state.add(1, other, len(PROMPT), len(PROMPT), [])
    with pytest.raises(RuntimeError, match="could not compile a constraint the gateway accepted"):
        state._matcher(state.rows[1])


@pytest.mark.skipif(not TOKENIZER.exists(), reason="needs the default model's tokenizer")
def test_the_batch_accept_reads_refusals_as_xgrammars_own_call_does():
    """grammar._batch_accept skips the public wrapper's per-item read when nothing was refused;
    a refused token must still come back False, and a matcher must end where the public call
    leaves it."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from strata.services.worker.sampling.grammar import _batch_accept

    tokenizer = AutoTokenizer.from_pretrained(str(TOKENIZER))
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer)).compile_builtin_json_grammar()
    good = tokenizer.encode("[1")
    bad = tokenizer.encode("hello")[0]
    steps = [[good[0]] * 4, [good[1], bad, good[1], bad]]
    ours, theirs = ([xgr.GrammarMatcher(compiled) for _ in range(4)] for _ in range(2))
    for tokens in steps:
        got = list(_batch_accept(ours, tokens))
        want = xgr.BatchGrammarMatcher.batch_accept_token(theirs, tokens)
        assert got == want
    assert want == [True, False, True, False]  # the second step refused rows 1 and 3
    # the refused rows stayed where they were: they take what the public call's rows take
    assert [m.accept_token(good[1]) for m in ours] == [m.accept_token(good[1]) for m in theirs]

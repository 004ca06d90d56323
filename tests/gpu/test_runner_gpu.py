"""The worker's ModelRunner on a GPU: decode steps replayed from CUDA graphs that also sample and
resolve decode-lookahead placeholders inside the graph.

    python -m pytest tests/gpu/test_runner_gpu.py -q

Oracles: the Sampler run eagerly on the graph's own logits (the in-graph draw must pick the same
tokens), and a second runner given every input token explicitly (placeholders must resolve to
the tokens the worker sampled).
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()

from strata.protocol import PLACEHOLDER_TOKEN  # noqa: E402
from strata.services.worker.runner import ModelRunner  # noqa: E402
from strata.services.worker.sampling.sampler import Sampler, SamplingTensors  # noqa: E402
from strata.v1 import engine_pb2  # noqa: E402
from tests.gpu_shards import llama_1b_like, random_bf16_shard  # noqa: E402

BLOCK_SIZE = 16
BLOCKS_PER_SEQ = 8
MAX_SEQS = 16
# (temperature, top_k, seed) per sequence: greedy and seeded rows side by side.
UNFILTERED = [(0.0, 0, 11), (1.0, 0, 12), (0.7, 0, 13), (1.3, 0, 14), (0.0, 0, 15), (1.0, 0, 16)]


@pytest.fixture(scope="module")
def shard_and_config():
    config = llama_1b_like(num_layers=2)
    return random_bf16_shard(config), config


def new_runner(shard, config, blocks_per_seq: int = BLOCKS_PER_SEQ, piecewise_max_tokens: int = 0) -> ModelRunner:
    runner = ModelRunner(
        shard,
        config,
        stage_index=0,
        num_stages=1,
        block_size=BLOCK_SIZE,
        max_model_len=BLOCK_SIZE * blocks_per_seq,
        device=torch.device("cuda"),
        dtype=torch.bfloat16,
        max_num_seqs=MAX_SEQS,
        cuda_graph_max_batch=MAX_SEQS,
        piecewise_max_tokens=piecewise_max_tokens,
    )
    runner.init_cache(MAX_SEQS * blocks_per_seq)
    return runner


def admit_plan(settings, prompts, first_seq_id: int = 1, blocks_per_seq: int = BLOCKS_PER_SEQ) -> engine_pb2.StepPlan:
    seq_ids = list(range(first_seq_id, first_seq_id + len(prompts)))
    return engine_pb2.StepPlan(
        step_id=1,
        new_sequences=[
            engine_pb2.NewSequence(
                seq_id=s, sampling=engine_pb2.SamplingOptions(temperature=t, top_k=k, top_p=1.0, seed=seed, logprobs=-1)
            )
            for s, (t, k, seed) in zip(seq_ids, settings)
        ],
        seq_ids=seq_ids,
        num_computed=[0] * len(prompts),
        num_scheduled=[len(p) for p in prompts],
        input_token_ids=[t for p in prompts for t in p],
        table_keep=[0] * len(prompts),
        table_append_counts=[blocks_per_seq] * len(prompts),
        table_append_ids=[(s - 1) * blocks_per_seq + b for s in seq_ids for b in range(blocks_per_seq)],
        sample=[True] * len(prompts),
    )


def decode_plan(step_id: int, lengths: list[int], tokens: list[int]) -> engine_pb2.StepPlan:
    n = len(lengths)
    return engine_pb2.StepPlan(
        step_id=step_id,
        seq_ids=list(range(1, n + 1)),
        num_computed=lengths,
        num_scheduled=[1] * n,
        input_token_ids=tokens,
        table_keep=[BLOCKS_PER_SEQ] * n,
        table_append_counts=[0] * n,
        sample=[True] * n,
    )


def prompts_for(n: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 8192, (int(length),), generator=gen).tolist()
        for length in torch.randint(5, 40, (n,), generator=gen)
    ]


def eager_sample(runner: ModelRunner, settings, lengths: list[int]) -> torch.Tensor:
    """The Sampler on the logits the last replayed graph produced, with the rows' own settings."""
    n = len(lengths)
    logits = runner.graphs.outputs[runner.graphs.padded_size(n)][0][:n]
    st = SamplingTensors.build(
        temperature=[t for t, _, _ in settings],
        top_k=[k for _, k, _ in settings],
        top_p=[1.0] * n,
        min_p=[0.0] * n,
        seeds=[s for _, _, s in settings],
        positions=[length + 1 for length in lengths],
        num_logprobs=-1,
        device="cuda",
    )
    return Sampler()(logits, st).token_ids.cpu()


def test_graph_draw_and_placeholders_match_explicit_tokens_and_the_sampler(shard_and_config):
    shard, config = shard_and_config
    prompts = prompts_for(len(UNFILTERED), seed=1)
    ahead, explicit = new_runner(shard, config), new_runner(shard, config)
    first = ahead.execute(admit_plan(UNFILTERED, prompts)).finish()
    assert list(explicit.execute(admit_plan(UNFILTERED, prompts)).finish().token_ids) == list(first.token_ids)
    lengths = [len(p) for p in prompts]
    tokens = list(first.token_ids)
    # `ahead` runs like the worker under decode lookahead: each plan carries placeholders and is
    # launched before the previous step's tokens reached the host.
    pending = ahead.execute(decode_plan(2, lengths, [PLACEHOLDER_TOKEN] * len(prompts)))
    for step in range(3, 9):
        launched = ahead.execute(decode_plan(step, [x + 1 for x in lengths], [PLACEHOLDER_TOKEN] * len(prompts)))
        got = list(pending.finish().token_ids)
        want = list(explicit.execute(decode_plan(step - 1, lengths, tokens)).finish().token_ids)
        assert got == want, f"step {step - 1}: placeholders resolved to other tokens than the sampled ones"
        assert torch.equal(eager_sample(explicit, UNFILTERED, lengths), torch.tensor(got)), (
            f"step {step - 1}: the in-graph draw differs from the Sampler on the same logits"
        )
        assert len(set(got)) > 1
        lengths = [x + 1 for x in lengths]
        tokens, pending = got, launched
    pending.finish()


def test_decode_again_equals_decode_plans_of_placeholders(shard_and_config):
    """ModelRunner.decode_again (a draft worker's proposal steps) replays the latest decode graph
    moved on by a token on the device: the same tokens as decode plans of placeholders, step by
    step, greedy and seeded rows."""
    shard, config = shard_and_config
    prompts = prompts_for(len(UNFILTERED), seed=4)
    again, planned = new_runner(shard, config), new_runner(shard, config)
    first = list(again.execute(admit_plan(UNFILTERED, prompts)).finish().token_ids)
    assert list(planned.execute(admit_plan(UNFILTERED, prompts)).finish().token_ids) == first
    lengths = [len(p) for p in prompts]
    n = len(prompts)
    rows = torch.tensor(again.table.lookup(list(range(1, n + 1))), device="cuda")
    # A decode of known tokens on the graph, then placeholder steps both ways.
    want = list(planned.execute(decode_plan(2, lengths, first)).finish().token_ids)
    assert list(again.execute(decode_plan(2, lengths, first)).finish().token_ids) == want
    replayed = 0
    for step in range(3, 40):  # (across blocks: a plan where the staged tables end)
        lengths = [x + 1 for x in lengths]
        if again.decode_again():
            replayed += 1
        else:
            again.execute(decode_plan(step, lengths, [PLACEHOLDER_TOKEN] * n)).finish()
        got = again.last_sampled.index_select(0, rows).tolist()
        want = list(planned.execute(decode_plan(step, lengths, [PLACEHOLDER_TOKEN] * n)).finish().token_ids)
        positions = again.graphs.rows["positions"][:n].tolist()
        assert got == want, f"step {step}: decode_again drew {got}, decode plans {want} (positions {positions})"
    assert 0 < replayed < 37
    again.execute(admit_plan(UNFILTERED[:1], prompts[:1], first_seq_id=n + 1)).finish()
    assert not again.decode_again()  # the latest step was a prefill: nothing to replay


def test_filtered_rows_are_sampled_outside_the_graph(shard_and_config):
    """A top-k row sends the step down the eager Sampler on the graph's logits; the tokens it
    leaves in last_sampled (over the graph's own draw) feed the next placeholder step."""
    shard, config = shard_and_config
    settings = UNFILTERED[:3] + [(1.0, 3, 21)] + UNFILTERED[3:]
    prompts = prompts_for(len(settings), seed=2)
    ahead, explicit = new_runner(shard, config), new_runner(shard, config)
    tokens = list(ahead.execute(admit_plan(settings, prompts)).finish().token_ids)
    explicit.execute(admit_plan(settings, prompts)).finish()
    lengths = [len(p) for p in prompts]
    for step in range(2, 6):
        got = list(ahead.execute(decode_plan(step, lengths, [PLACEHOLDER_TOKEN] * len(prompts))).finish().token_ids)
        want = list(explicit.execute(decode_plan(step, lengths, tokens)).finish().token_ids)
        assert got == want
        assert torch.equal(eager_sample(explicit, settings, lengths), torch.tensor(got))
        n = len(lengths)
        logits = explicit.graphs.outputs[explicit.graphs.padded_size(n)][0][:n].float()
        assert got[3] in logits[3].topk(3).indices.tolist(), "the top-k row drew outside its top 3"
        lengths = [x + 1 for x in lengths]
        tokens = got


def _compiled_variants() -> dict[str, int]:
    """Compiled variants of every Triton kernel in kernels/, by name."""
    import importlib
    import pkgutil

    from triton.runtime.jit import JITFunction

    from strata import kernels

    counts = {}
    for info in pkgutil.iter_modules(kernels.__path__):
        module = importlib.import_module(f"strata.kernels.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, JITFunction):
                counts[f"{info.name}.{name}"] = sum(len(cache[0]) for cache in obj.device_caches.values())
    return counts


def test_serving_compiles_no_kernel_after_warm_up(shard_and_config):
    """Eager steps whose shapes differ from the warm-up's (prompt lengths, block-table widths of
    1, of a multiple of 16 and of neither, decodes beside prefill chunks, filtered sampling) run
    on kernels compiled at cache init: a compile mid-serving stalls every request ~1 s."""
    shard, config = shard_and_config
    runner = new_runner(shard, config, blocks_per_seq=40)
    before = _compiled_variants()
    gen = torch.Generator().manual_seed(3)
    seq_id = 1
    for length in (5, 16 * 16, 16 * 33 + 3, 16 * 7):  # block-table widths 1, 16, 34, 7
        settings = [(1.0, 0, seq_id), (0.0, 0, seq_id + 1), (0.8, 5, seq_id + 2)]
        prompts = [torch.randint(3, 8192, (n,), generator=gen).tolist() for n in (length, 3, length // 2 + 1)]
        runner.execute(admit_plan(settings, prompts, first_seq_id=seq_id, blocks_per_seq=40)).finish()
        seq_id += 3
    assert _compiled_variants() == before


def verify_plan(step_id: int, lengths: list[int], last: list[int], drafts: list[list[int]]) -> engine_pb2.StepPlan:
    """Each sequence computes its last token and its drafts; lengths: tokens before the last."""
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


def test_verification_graphs_accept_the_plain_decode_tokens(shard_and_config):
    """Drafts equal to what plain decode steps drew are accepted (verify rows draw from the same
    (seed, position)); a wrong draft is cut at its position with the target's own draw. Uniform
    draft counts replay verification graphs, mixed ones run eagerly: both give the same tokens.
    In bf16 a verify row need not round like the decode step; a divergence must be a near-tie."""
    shard, config = shard_and_config
    k = 3
    settings = UNFILTERED[:4]
    prompts = prompts_for(len(settings), seed=4)
    plain, spec = new_runner(shard, config), new_runner(shard, config)
    spec.verify_query_lens, spec.verify_max_batch = range(2, k + 2), MAX_SEQS
    spec.init_cache(MAX_SEQS * BLOCKS_PER_SEQ)  # captures the verification graphs too
    assert sorted(spec.verify_graphs) == [2, 3, 4]
    first = list(plain.execute(admit_plan(settings, prompts)).finish().token_ids)
    assert list(spec.execute(admit_plan(settings, prompts)).finish().token_ids) == first
    lengths, out = [len(p) for p in prompts], [[t] for t in first]
    for step in range(2, 2 + 2 * k):  # the plain run: 2k more tokens per sequence
        out_step = (
            plain.execute(decode_plan(step, [x + len(o) - 1 for x, o in zip(lengths, out)], [o[-1] for o in out]))
            .finish()
            .token_ids
        )
        for o, t in zip(out, out_step):
            o.append(t)
    # Round 1, uniform (graphs): drafts are the plain run's next k tokens, the last one wrong for seq 2.
    drafts = [o[1 : 1 + k] for o in out]
    drafts[2] = drafts[2][:2] + [(drafts[2][2] + 1) % config.vocab_size]
    result = spec.execute(verify_plan(10, lengths, [o[0] for o in out], drafts)).finish()
    # Round 2, mixed draft counts (eager).
    emitted = _split(result)
    agree = sum(e == o[1 : 1 + len(e)] for e, o in zip(emitted, out))
    assert [len(e) for e in emitted][2] <= 3 and agree >= 3, (emitted, out)
    nxt = [len(e) for e in emitted]
    mixed = [o[1 + m : 1 + m + d] for o, m, d in zip(out, nxt, (0, 1, 2, 1))]
    result = spec.execute(
        verify_plan(11, [x + m for x, m in zip(lengths, nxt)], [o[m] for o, m in zip(out, nxt)], mixed)
    ).finish()
    for e, o, m in zip(_split(result), out, nxt):
        assert e == o[1 + m : 1 + m + len(e)] or len(e) == 1


def _split(result) -> list[list[int]]:
    tokens, pos, out = list(result.token_ids), 0, []
    for n in result.num_tokens:
        out.append(tokens[pos : pos + n])
        pos += n
    return out


# --- shared prefixes: cascade attention in decode graphs and eager steps ---------------------

SHARED = 32  # the first two blocks of sequence 1's prompt, which sequences 2-4 take


def _table(seq: int, shares: bool) -> list[int]:
    own = [(seq - 1) * BLOCKS_PER_SEQ + b for b in range(BLOCKS_PER_SEQ)]
    return [0, 1] + own[2:] if shares else own


def shared_prefix_plan(
    step_id: int,
    seqs: list[int],
    computed: list[int],
    tokens: list[list[int]],
    new: list[int],
    shares: set[int],
    grouped: bool,
) -> engine_pb2.StepPlan:
    """Sequences in plan order (the sharing ones last, consecutive, as the scheduler sends them);
    new: those admitted in this step, with their whole block table."""
    plan = engine_pb2.StepPlan(
        step_id=step_id,
        seq_ids=seqs,
        num_computed=computed,
        num_scheduled=[len(t) for t in tokens],
        input_token_ids=[t for ts in tokens for t in ts],
        sample=[True] * len(seqs),
        new_sequences=[
            engine_pb2.NewSequence(
                seq_id=s, sampling=engine_pb2.SamplingOptions(temperature=0.0, top_p=1.0, seed=s, logprobs=-1)
            )
            for s in new
        ],
        table_keep=[0 if s in new else BLOCKS_PER_SEQ for s in seqs],
        table_append_counts=[BLOCKS_PER_SEQ if s in new else 0 for s in seqs],
        table_append_ids=[b for s in seqs if s in new for b in _table(s, s in shares and s != 1)],
    )
    if grouped:
        plan.shared_kv_run.extend([1 if s in shares else 0 for s in seqs])
        plan.shared_kv_run_lens.append(SHARED)
    return plan


def test_cascade_graphs_and_eager_cascade_match_plain_attention(shard_and_config):
    """Sequences 2-4 share sequence 1's first 32 prompt tokens (its blocks 0 and 1), 5 and 6 share
    nothing. One runner is told the group (cascade: decode graphs of their own, and an eager step
    beside a new prompt), the other is not: logits agree to bf16 rounding, tokens are equal."""
    shard, config = shard_and_config
    gen = torch.Generator().manual_seed(9)
    head = torch.randint(3, 8192, (SHARED,), generator=gen).tolist()
    # Short own parts: the group must save half the step's KV reads, or the worker (rightly)
    # runs the plain kernel (cascade_inputs.MIN_SAVED_FRACTION).
    prompts = {1: head + torch.randint(3, 8192, (2,), generator=gen).tolist()}
    for s in (2, 3, 4):
        prompts[s] = head + torch.randint(3, 8192, (s - 1,), generator=gen).tolist()
    for s in (5, 6, 7):
        prompts[s] = torch.randint(3, 8192, (s - 3,), generator=gen).tolist()
    shares = {1, 2, 3, 4}
    runs = {}
    for grouped in (True, False):
        runner = new_runner(shard, config)
        out = {s: [] for s in prompts}

        def run(plan, seqs):
            tokens = list(runner.execute(plan).finish().token_ids)
            for s, t in zip(seqs, tokens):
                out[s].append(t)
            return tokens

        first = [5, 6, 1]
        run(shared_prefix_plan(1, first, [0] * 3, [prompts[s] for s in first], first, shares, False), first)
        joining = [2, 3, 4]  # take sequence 1's two blocks, compute only their own tokens
        run(
            shared_prefix_plan(
                2, joining, [SHARED] * 3, [prompts[s][SHARED:] for s in joining], joining, shares, False
            ),
            joining,
        )
        length = {s: len(prompts[s]) for s in prompts}
        order = [5, 6, 1, 2, 3, 4]
        logits = []
        for step in range(3, 7):  # decode steps: the cascade graph replays
            run(
                shared_prefix_plan(
                    step,
                    order,
                    [length[s] + len(out[s]) - 1 for s in order],
                    [[out[s][-1]] for s in order],
                    [],
                    shares,
                    grouped,
                ),
                order,
            )
            graphs = runner.cascade_graphs if grouped else runner.graphs
            logits.append(graphs.outputs[graphs.padded_size(6, 1 if grouped else 0)][0][:6].float().clone())
        # An eager step: sequence 7's prompt beside the group's decodes.
        mixed = [7, 5, 6, 1, 2, 3, 4]
        run(
            shared_prefix_plan(
                7,
                mixed,
                [0] + [length[s] + len(out[s]) - 1 for s in mixed[1:]],
                [prompts[7]] + [[out[s][-1]] for s in mixed[1:]],
                [7],
                shares,
                grouped,
            ),
            mixed,
        )
        runs[grouped] = (out, logits, runner.cascade_graphs.step)
    (cascade_out, cascade_logits, cascade_replays), (plain_out, plain_logits, plain_replays) = runs[True], runs[False]
    assert cascade_replays == 4 and plain_replays == 0, "the grouped decode steps replay the cascade graphs"
    # Greedy tokens agree unless the plain run's top two logits are within the rounding tolerance
    # (a bf16 tie: on random weights two of the top logits are often equal), where either
    # token is right; such a row's later steps see different inputs, so it is compared no further.
    # (H200, 77b6cef: sequence 6's top two logits were equal in the first decode step.)
    compared = [True] * len(order)
    for step, (got, want) in enumerate(zip(cascade_logits, plain_logits)):
        tolerance = 0.02 * want.abs().max()
        for row, seq in enumerate(order):
            if not compared[row]:
                continue
            assert (got[row] - want[row]).abs().max() <= tolerance, f"step {step}, sequence {seq}: beyond bf16 rounding"
            if cascade_out[seq][1 + step] != plain_out[seq][1 + step]:
                top2 = want[row].topk(2).values
                assert top2[0] - top2[1] <= tolerance, f"step {step}, sequence {seq}: a clear argmax differs"
                compared[row] = False
    assert sum(compared) >= len(order) - 1, "more than one tie: the comparison would say little"
    assert {s: t for s, t in cascade_out.items() if s not in order or compared[order.index(s)]} == {
        s: t for s, t in plain_out.items() if s not in order or compared[order.index(s)]
    }


def test_mixed_steps_replay_the_piecewise_graphs(shard_and_config):
    """Steps that admit a prompt beside decodes (by placeholder) replay the piecewise graphs; a
    runner without them runs the same plans eagerly: logits agree to bf16 rounding and greedy
    tokens are equal (a sequence whose top two logits tie within that rounding, where either
    token is right, is compared no further: its later inputs differ)."""
    shard, config = shard_and_config
    gen = torch.Generator().manual_seed(12)
    prompts = {
        s: torch.randint(3, 8192, (int(n),), generator=gen).tolist()
        for s, n in zip(range(1, 8), torch.randint(5, 60, (7,), generator=gen))
    }
    runs = {}
    for piecewise in (True, False):
        runner = new_runner(shard, config, piecewise_max_tokens=256 if piecewise else 0)
        steps, replays = [], []  # per step: (plan order, logits, tokens)
        sampler, run_pieces = runner.sampler, runner.piecewise and runner.piecewise.run

        def record(logits, sampling, sampler=sampler, steps=steps):
            steps[-1].append(logits.float().clone())
            return sampler(logits, sampling)

        runner.sampler = record
        if piecewise:
            runner.piecewise.run = lambda tp, *args: replays.append(tp) or run_pieces(tp, *args)
        generated, running = {s: [] for s in prompts}, [1, 2, 3]
        plan = shared_prefix_plan(1, running, [0] * 3, [prompts[s] for s in running], running, set(), False)
        for step in range(2, 7):
            steps.append([list(plan.seq_ids)])
            tokens = list(runner.execute(plan).finish().token_ids)
            steps[-1].append(tokens)
            for s, t in zip(plan.seq_ids, tokens):
                generated[s].append(t)
            new = [step + 2] if step + 2 in prompts else []
            computed = [len(prompts[s]) + len(generated[s]) - 1 for s in running]
            plan = shared_prefix_plan(
                step,
                new + running,
                [0] * len(new) + computed,
                [prompts[s] for s in new] + [[PLACEHOLDER_TOKEN]] * len(running),
                new,
                set(),
                False,
            )
            running = new + running
        runs[piecewise] = (steps, replays)
    (pieces, replays), (eager, _) = runs[True], runs[False]
    assert len(replays) == len(eager) == 5, "every mixed step replays the pieces"
    diverged = set()
    for step, ((order, got, got_tokens), (_, want, want_tokens)) in enumerate(zip(pieces, eager)):
        tolerance = 0.02 * want.abs().max()
        for row, seq in enumerate(order):
            if seq in diverged:
                continue
            assert (got[row] - want[row]).abs().max() <= tolerance, f"step {step}, sequence {seq}: beyond bf16 rounding"
            if got_tokens[row] != want_tokens[row]:
                top2 = want[row].topk(2).values
                assert top2[0] - top2[1] <= tolerance, f"step {step}, sequence {seq}: a clear argmax differs"
                diverged.add(seq)
    assert len(diverged) <= 1, "more than one tie: the comparison would say little"

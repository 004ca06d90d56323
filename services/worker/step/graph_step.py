"""A step replayed on a captured decode or verification graph (runner.py's execute() picks the
graph and its padded size): which rows the graph draws itself, the controlled draw of rows under
penalties or a grammar beside it, speculation's commit inside the graph, and the decode a draft
worker may replay moved on by a token (ModelRunner.decode_again).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from strata.services.worker.step.sequence_table import PlanError
from strata.services.worker.step.step_inputs import HostInputs
from strata.services.worker.step.step_results import PendingResult
from strata.services.worker.transport.token_handoff import TokenOutlet


@dataclass(slots=True)
class DecodeReplay:
    """A decode step decode_again may replay: its graphs, padded size and sequences, and the
    tokens each sequence may still move on within the block tables the step staged."""

    graphs: object
    padded_size: int
    num_seqs: int
    room: int


def run_on_graph(runner, graphs, plan, h: HostInputs, bs: int, arrive, start: float, spec):
    """A step on the graph of padded size bs. Every token's row is drawn in the graph (a row
    draws the token after it, from (seed, position + 1)); when every token is a sample row
    without filters or logprobs, that draw is the result. Otherwise the sampler runs on the
    graph's logits (the graph's draw skips every row then). Rows under penalties or a grammar
    beside unfiltered ones: the graph draws the others and the controlled draw these
    (sampling_controls.py), one draw per row either way."""
    t, token_rows = runner.table, h.token_rows
    num_tokens = len(token_rows)
    all_rows = len(h.sample_rows) == num_tokens
    padded = not all_rows and h.verify is not None  # pad_queries: every real token samples
    draws = graphs.samples and (all_rows or padded)
    in_graph = draws and bool(t.unfiltered[token_rows].all())
    c = runner.controls
    controlled = (  # a step that also speculates on the device takes the general path
        spec is None
        and draws
        and not in_graph
        and c is not None
        and bool((t.unfiltered[token_rows] | c.drawable[token_rows]).all())
        and c.can_draw(token_rows)
    )
    sampling_rows = None
    if graphs.samples:
        skip = c.controlled[token_rows] if controlled else np.full(num_tokens, not in_graph)
        sampling_rows = {
            "seeds": t.seed[token_rows],
            "sample_positions": h.positions + 1,
            "inv_temperature": t.inv_temperature[token_rows],
            "greedy": t.greedy[token_rows],
            "skip_draw": skip,
        }
    if controlled:
        c.mark_launch()
        logits, tokens = graphs.run(bs, h, h.placeholder_rows, sampling_rows, arrive)
        c.draw_controlled(
            plan,
            h,
            logits,
            tokens,
            graphs.draw_settings(num_tokens),
            h.sample_token_index if padded else None,
            graphs.draw_store(num_tokens),
        )
        return PendingResult(
            plan.step_id,
            start,
            h.sample_seq_ids,
            t.logprobs[h.sample_rows],
            [tokens],
            runner.timeline,
            runner.gpu_start,
            h.verify,
            take=h.sample_token_index if padded else None,
        )
    d = sampling = None
    # A verification graph whose draw is the result commits it and proposes in the graph.
    commits = in_graph and spec is not None and spec.plain is None and getattr(graphs, "commits", False)
    if spec is not None and spec.rounds > 1 and not commits:  # (execute() ran such steps eagerly)
        raise PlanError("several verify rounds on a graph need its draw to be the result")
    stage_extra = None  # a verification graph stages the meta rows with its inputs
    if spec is not None:  # the verification graphs read them to move positions
        stage_extra = runner.spec.stage(spec, h, bs, commits_in_graph=commits, graphs=graphs)
    if runner.is_last and h.sample_seq_ids and not in_graph:
        d, sampling = runner.inputs.upload(h, eager=False)
        if spec is not None:
            runner.spec.shift_sampling(spec, sampling, d["sample_token_index"], graphs.query_len)
    outs = graphs.run(bs, h, h.placeholder_rows, sampling_rows, arrive, stage_extra)
    if not runner.is_last:
        return outs
    if in_graph:  # the graph drew every row (pads too): keep the sample rows'
        packed = None
        take = h.sample_token_index if padded else None
        if commits and spec.rounds > 1:  # the other rounds replay the graph, moved on
            draws, packed = runner.spec.graph_rounds(graphs, bs, spec, outs[1])
            return runner.rounds_result(plan, h, start, spec, draws, packed, take)
        if commits:
            packed = runner.spec.committed_in_graph(spec)
        elif spec is not None:
            packed = runner.spec.after_draw(spec, outs[1], per_token=True)
        elif graphs is runner.graphs:  # a plain decode: decode_again may replay it moved on
            # The staged tables hold only the blocks this step reaches: the room left in them.
            room = int((h.block_tables.shape[1] * runner.block_size - h.seq_lens).min())
            runner.decode_graph_step = DecodeReplay(graphs, bs, num_tokens, room)
        if spec is None and take is None and isinstance(runner.handoff, TokenOutlet):
            runner.handoff.drawn(outs[1])  # every token drawn, in token order: stage 0's tokens
        return PendingResult(
            plan.step_id,
            start,
            h.sample_seq_ids,
            t.logprobs[h.sample_rows],
            [outs[1]],
            runner.timeline,
            runner.gpu_start,
            h.verify,
            take=take,
            speculation=(packed, spec.sample_idx) if packed is not None else None,
        )
    logits = sample_rows = None
    if h.sample_seq_ids:
        logits = outs[0] if all_rows else outs[0][d["sample_token_index"]]
        sample_rows = d["sample_rows"]
    return runner.sample_result(plan, h, logits, sample_rows, sampling, start, spec)

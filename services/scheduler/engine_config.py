"""The engine's settings (SchedulerConfig) and the defaults that follow the pipeline's shape: how
many micro-batches pipelined decode runs, and how many plans the engine keeps in flight."""

from __future__ import annotations

from dataclasses import dataclass

from strata.flags import DEFAULTS
from strata.services.scheduler.speculation.config import SpeculativeConfig


def default_micro_batches(stages: int, share_one_gpu: bool) -> int:
    """The most micro-batches of pipelined decode over `stages` > 1 stages.

    P + 2 keep P GPUs busy while a micro-batch's plan crosses the stages, its result reaches the
    scheduler and its next plan the first stage: on two H200s (8B, 1,024 requests) that round took
    about 40 ms against two 8 ms steps, and with P + 1 each stage waited 6 ms a step for its input
    (12,766 output tok/s; P + 2: 20,223, two replicas 20,455 in the same run: bench/RESULTS.md,
    issue 50 on two GPUs). Stages sharing one GPU take turns on it: P suffice, and fewer, larger
    micro-batches mean fewer steps, each costing every stage a whole step's host work
    ("Figures moved from code comments")."""
    return stages + (0 if share_one_gpu else 2)


def plans_in_flight(stages: int, micro_batches: int) -> int:
    """The engine's plans in flight by default. One stage: 3, the later two decode lookaheads of
    the first's requests, so the host has two GPU steps to turn a result into the next plan
    (bench/RESULTS.md, "Figures moved from code comments", has the A/B against 2 plans). P stages,
    pipelined decode: two per micro-batch (the one running and its lookahead; a lone micro-batch
    takes up to P + 1, its lookahead depth)."""
    return 3 if stages == 1 else max(2 * micro_batches, stages + 1)


@dataclass
class SchedulerConfig:
    """The engine's settings. Each default that a flag has is the flag table's (strata/flags.py):
    written there only; `strata scheduler` passes every one from its flags."""

    max_num_seqs: int = DEFAULTS["max_num_seqs"]
    max_num_batched_tokens: int = DEFAULTS["max_num_batched_tokens"]
    # 0: 3 with one stage (the extra plans are decode lookaheads), else 2 per micro-batch
    max_plans_in_flight: int = DEFAULTS["max_plans_in_flight"]
    # Pipelined decode over P > 1 stages: the last stage hands its tokens to stage 0, and requests
    # run in micro-batches (at most pipeline_micro_batches, 0: P + 2; how many follows the load,
    # services/scheduler/micro_batches.py), each a chain of plans whose decodes are lookaheads of
    # the previous plan's.
    pipelined_decode: bool = not DEFAULTS["no_pipelined_decode"]
    pipeline_micro_batches: int = DEFAULTS["pipeline_micro_batches"]
    micro_batch_min_seqs: int = DEFAULTS["micro_batch_min_seqs"]
    decode_repeats: int = DEFAULTS["decode_repeats"]  # a steady micro-batch's plans committed at once (repeats.py)
    # One stage: hold the next plan while the plans in flight keep the GPU busy (plan_pacing.py).
    plan_pacing: bool = not DEFAULTS["no_plan_pacing"]
    enable_prefix_caching: bool = not DEFAULTS["no_prefix_caching"]
    # Send shared-KV runs in the plans (worker: cascade attention).
    cascade_attention: bool = not DEFAULTS["disable_cascade_attn"]
    max_kv_blocks: int = DEFAULTS["max_kv_blocks"]  # 0: whatever the smallest stage offers
    # A new request waits this long for a pipeline that is reconnecting, then gets UNAVAILABLE (503
    # over HTTP) so that clients retry elsewhere; requests already running pause until it is back.
    reconnect_timeout: float = 2.0
    speculation: SpeculativeConfig | None = None
    # A lost stage: requests wait this long for the pipeline to come back, then fail.
    stage_recovery_timeout: float = DEFAULTS["stage_recovery_timeout"]
    # A step of max_num_batched_tokens tokens that takes longer means a hung stage (smaller steps
    # get a proportional share, at least a tenth, and never less than a few times the slowest
    # recent step: a loaded CPU worker is slow, not hung).
    step_timeout: float = DEFAULTS["step_timeout"]

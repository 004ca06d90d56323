"""`strata scheduler`: connect to the workers, then serve the Scheduler service."""

from __future__ import annotations

import asyncio
import logging

from strata.gc_tuning import tune_for_serving
from strata.grpc_util import add_service, bind, new_server, set_serving, wait_for_termination_signal
from strata.services.scheduler.engine import Engine
from strata.services.scheduler.engine_config import SchedulerConfig
from strata.services.scheduler.metrics import serve_metrics
from strata.services.scheduler.pipeline import Pipeline
from strata.services.scheduler.server import SchedulerServicer
from strata.services.scheduler.speculation.config import SpeculativeConfig
from strata.v1 import engine_pb2

log = logging.getLogger("strata.scheduler")


def speculation_from_args(args) -> SpeculativeConfig | None:
    if not args.speculative_method:
        return None
    if args.speculative_method == "draft" and not args.draft_worker:
        raise SystemExit("--speculative-method draft needs --draft-worker HOST:PORT")
    try:
        return SpeculativeConfig(
            args.speculative_method,
            args.num_speculative_tokens,
            args.ngram_min,
            args.ngram_max,
            args.speculative_max_batch,
            proposer=args.ngram_proposer,
            adaptive=not args.no_adaptive_speculation,
            rounds=args.speculative_rounds,
            rounds_max_batch=args.speculative_rounds_max_batch,
        )
    except ValueError as e:
        raise SystemExit(f"speculative decoding: {e}") from None


def config_from_args(args) -> SchedulerConfig:
    return SchedulerConfig(
        speculation=speculation_from_args(args),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_plans_in_flight=args.max_plans_in_flight,
        pipelined_decode=not args.no_pipelined_decode,
        plan_pacing=not args.no_plan_pacing,
        pipeline_micro_batches=args.pipeline_micro_batches,
        micro_batch_min_seqs=args.micro_batch_min_seqs,
        decode_repeats=args.decode_repeats,
        enable_prefix_caching=not args.no_prefix_caching,
        cascade_attention=not args.disable_cascade_attn,
        max_kv_blocks=args.max_kv_blocks,
        stage_recovery_timeout=args.stage_recovery_timeout,
        step_timeout=args.step_timeout,
    )


async def serve(args) -> None:
    addresses = [a.strip() for a in args.workers.split(",") if a.strip()]
    config = config_from_args(args)
    draft = args.draft_worker if config.speculation and config.speculation.method == "draft" else None
    server, health = new_server()

    async def on_serving(serving: bool) -> None:  # NOT_SERVING while a stage is down
        await set_serving(health, ["strata.v1.Scheduler"], serving=serving)

    pipeline = Pipeline(
        addresses,
        draft_address=draft,
        draft_link=args.draft_proposals == "link",
        token=args.cluster_token,
        stage_transport=args.stage_transport,
        # Longer than a step may take: the engine's step deadline notices a hung stage first.
        transport_timeout=max(120.0, 4 * args.step_timeout),
    )
    engine = Engine(pipeline, config, on_serving=on_serving)
    add_service(
        server, SchedulerServicer(engine), engine_pb2.DESCRIPTOR.services_by_name["Scheduler"], token=args.cluster_token
    )
    port = bind(server, args.host, args.port)
    await set_serving(health, ["strata.v1.Scheduler"], serving=False)
    await server.start()  # health answers NOT_SERVING until the pipeline is up
    await engine.start()
    tune_for_serving()
    await set_serving(health, ["strata.v1.Scheduler"])
    if args.metrics_port:
        serve_metrics(engine.stats, args.metrics_port, args.host)
    log.info("scheduler on %s:%d over %d stage(s)", args.host, port, len(addresses))
    await wait_for_termination_signal()
    await server.stop(grace=1.0)
    await engine.stop()


def run(args) -> int:
    asyncio.run(serve(args))
    return 0

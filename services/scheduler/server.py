"""Scheduler gRPC service: the gateway submits child requests and streams their tokens back
(Submit: a call per request; Session: all of a gateway's requests over one stream, session.py)."""

from __future__ import annotations

import logging

import grpc

from strata.sampling_rules import check_sampling_options
from strata.services.scheduler.engine import Engine
from strata.services.scheduler.output_stream import RequestFailed
from strata.services.scheduler.request import Request
from strata.services.scheduler.session import Session
from strata.v1 import engine_pb2, engine_pb2_grpc, generate_pb2

log = logging.getLogger("strata.scheduler")


def request_from_proto(msg: engine_pb2.EngineRequest, model: generate_pb2.ModelInfo) -> Request:
    """Checks everything the scheduler and the workers rely on; Scheduler.add_request checks the
    rest (empty prompt, length). The gateway resolved every default and validated the user's
    input with messages naming the public fields: this guards the internal boundary."""
    if not msg.request_id:
        raise ValueError("request_id is empty")
    vocab = model.vocab_size
    _check_ids("prompt_token_ids", msg.prompt_token_ids, vocab)
    # The scheduler's one check of the options (strata/sampling_rules.py); a SamplingRuleError is a ValueError.
    check_sampling_options(msg.sampling, vocab_size=vocab)
    stop = msg.stop
    if len(msg.prompt_token_ids) + stop.max_tokens > model.max_model_len:
        raise ValueError(
            f"prompt ({len(msg.prompt_token_ids)} tokens) plus stop.max_tokens ({stop.max_tokens}) "
            f"exceeds max_model_len {model.max_model_len}"
        )
    _check_ids("stop.stop_token_ids", stop.stop_token_ids, vocab)
    _check_ids("stop.eos_token_ids", stop.eos_token_ids, vocab)
    _check_ids("resume_output_token_ids", msg.resume_output_token_ids, vocab)
    if len(msg.resume_output_token_ids) >= stop.max_tokens:
        raise ValueError(
            f"resume_output_token_ids holds {len(msg.resume_output_token_ids)} tokens: fewer than "
            f"stop.max_tokens ({stop.max_tokens}) leave one to generate"
        )
    return Request.from_proto(msg)


def _check_ids(field: str, ids, vocab_size: int) -> None:
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):
        raise ValueError(f"{field} must be in [0, {vocab_size})")


class SchedulerServicer(engine_pb2_grpc.SchedulerServicer):
    def __init__(self, engine: Engine):
        self.engine = engine

    async def Submit(self, request, context):
        try:
            await self.engine.wait_ready()  # the model's limits are unknown while reconnecting
        except RequestFailed as e:
            await context.abort(getattr(grpc.StatusCode, e.code), e.message)
        try:
            req = request_from_proto(request, self.engine.pipeline.model_info.model)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            stream = await self.engine.submit(req, final_only=request.final_only)
        except RequestFailed as e:
            await context.abort(getattr(grpc.StatusCode, e.code), e.message)
        finished = False
        try:
            while True:
                try:
                    out = await stream.next()
                except RequestFailed as e:
                    finished = True
                    await context.abort(getattr(grpc.StatusCode, e.code), e.message)
                yield out
                if out.finish_reason:
                    finished = True
                    return
        finally:
            # The client went away (or the gateway cancelled on a stop string): free at once.
            if not finished:
                self.engine.abort(request.request_id)

    async def Session(self, request_iterator, context):
        """Every request of one gateway over this stream (session.py)."""
        session = Session(self.engine, lambda msg: request_from_proto(msg, self.engine.pipeline.model_info.model))
        async for message in session.run(request_iterator):
            yield message

    async def GetModelInfo(self, request, context):
        if not self.engine.ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the worker pipeline is not ready")
        desc = self.engine.pipeline.model_info
        info = generate_pb2.ModelInfo()
        info.CopyFrom(desc.model)
        info.pipeline_stages = self.engine.pipeline.num_stages
        info.num_kv_blocks = self.engine.pipeline.num_kv_blocks
        info.block_size = desc.block_size
        return info

    async def GetStats(self, request, context):
        return self.engine.stats()

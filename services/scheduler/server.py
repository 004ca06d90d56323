"""Scheduler gRPC service: the gateway submits child requests and streams their tokens back."""
from __future__ import annotations

import logging

import grpc

from strata.services.scheduler.engine import Engine, RequestFailed
from strata.services.scheduler.request import Request
from strata.v1 import engine_pb2, engine_pb2_grpc, generate_pb2

log = logging.getLogger("strata.scheduler")


def request_from_proto(msg: engine_pb2.EngineRequest, info: engine_pb2.WorkerDescription) -> Request:
    """Checks what the workers rely on (token ids in the vocabulary, a seed, sane sampling) and
    the length contract; Scheduler.add_request checks the rest (empty prompt, max_tokens). The
    gateway validates user input in full, with messages naming the field."""
    p = msg.params
    model = info.model
    if not msg.request_id:
        raise ValueError("request_id is empty")
    ids = msg.prompt_token_ids
    if ids and (min(ids) < 0 or max(ids) >= model.vocab_size):
        raise ValueError(f"prompt_token_ids must be in [0, {model.vocab_size})")
    max_tokens = p.max_tokens if p.HasField("max_tokens") else 16
    if len(msg.prompt_token_ids) + max_tokens > model.max_model_len:
        raise ValueError(f"prompt ({len(msg.prompt_token_ids)} tokens) plus max_tokens ({max_tokens}) "
                         f"exceeds max_model_len {model.max_model_len}")
    if not p.HasField("seed"):
        raise ValueError("params.seed must be set (the gateway assigns one)")
    temperature = p.temperature if p.HasField("temperature") else 1.0
    top_p = p.top_p if p.HasField("top_p") else 1.0
    if temperature < 0 or not (0 < top_p <= 1) or not (0 <= p.min_p <= 1) or p.top_k < -1:
        raise ValueError("sampling parameters out of range")
    return Request(
        request_id=msg.request_id,
        prompt_token_ids=list(msg.prompt_token_ids),
        temperature=temperature,
        top_k=max(p.top_k, 0),
        top_p=top_p,
        min_p=p.min_p,
        seed=p.seed,
        logprobs=p.logprobs if p.HasField("logprobs") else -1,
        max_tokens=max_tokens,
        min_tokens=p.min_tokens,
        stop_token_ids=set(p.stop_token_ids),
        eos_token_ids=set(model.eos_token_ids),
        ignore_eos=p.ignore_eos,
        parent_id=msg.parent_id,
    )


class SchedulerServicer(engine_pb2_grpc.SchedulerServicer):
    def __init__(self, engine: Engine):
        self.engine = engine

    async def Submit(self, request, context):
        try:
            await self.engine.wait_ready()  # the model's limits are unknown while reconnecting
        except RequestFailed as e:
            await context.abort(getattr(grpc.StatusCode, e.code), e.message)
        try:
            req = request_from_proto(request, self.engine.pipeline.model_info)
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

    async def Abort(self, request, context):
        n = sum(self.engine.abort(rid) for rid in request.request_ids)
        return engine_pb2.AbortReply(aborted=n)

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

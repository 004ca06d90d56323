"""The gateway's replicas (data parallelism): one scheduler each, every one a pipeline of its own.

`strata gateway --scheduler-address A,B,...` (or `strata serve --data-parallel-size D`) puts one
gateway in front of several schedulers. One scheduler per replica, not one for all: the
scheduler's single thread paces its pipeline (SchedulerStats.host_seconds), a crash loses one
replica's state rather than all, and a replica on another host is the same standalone services.

ReplicaSet keeps, per replica: whether it is up (its health SERVING, and it serves the first
replica's model: architecture, vocabulary, context, block size, dtype and EOS tokens, so a
request resumed on it draws the same tokens), the load this gateway put there (routing.py), the
scheduler's own statistics polled every half second, and the counts /metrics and GetModelInfo
show. It routes each request (route()), and moves the requests of a replica that is lost
(failover.py): at once when its calls fail with UNAVAILABLE (the scheduler is gone),
after --replica-failover-seconds when it says NOT_SERVING while it rebuilds a lost stage (its
requests wait there meanwhile, and resume in place if it is back in time). The gateway serves
while any replica is up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from strata.flags import DEFAULTS
from strata.grpc_util import aio_channel, bearer
from strata.services.gateway.failover import Route
from strata.services.gateway.routing import GROUP, LOAD, RESUME, Router, effective_load
from strata.services.gateway.scheduler_session import SchedulerSession
from strata.v1 import engine_pb2, engine_pb2_grpc, generate_pb2

log = logging.getLogger("strata.gateway")

# How often each replica's health is checked, and its statistics read (with several replicas).
HEALTH_INTERVAL = 1.0
STATS_INTERVAL = 0.5
# ModelInfo fields every replica must share with the first.
SAME_MODEL_FIELDS = ("architecture", "max_model_len", "vocab_size", "eos_token_ids", "block_size", "dtype")


@dataclass(eq=False)
class Replica:
    index: int
    address: str
    stub: engine_pb2_grpc.SchedulerStub
    channel: grpc.aio.Channel | None = None  # None: a stub handed in, always up (no health to follow)
    # Where requests go: one stream for all of them (scheduler_session.py); None: a Submit call each.
    session: SchedulerSession | None = None
    up: bool = False
    down_since: float | None = None  # time.monotonic() when it went down (None: up, or never seen)
    refused: str = ""  # why its model was refused, when it was
    info: generate_pb2.ModelInfo | None = None
    stats: engine_pb2.SchedulerStats | None = None
    stats_at: float = 0.0
    load_at_stats: int = 0  # load_tokens when the stats came
    load_tokens: int = 0  # tokens of the children this gateway has running there
    routed: Counter = field(default_factory=Counter)  # requests and groups routed there, by reason
    resumed: int = 0  # children resumed there from a lost replica
    calls: set = field(default_factory=set)  # failover.ReplicaCall running there

    def others_tokens(self, now: float) -> float | None:
        """Tokens its scheduler held at the last poll beyond what this gateway had there then."""
        if self.stats is None or now - self.stats_at > 4 * STATS_INTERVAL:
            return None
        return max(0, self.stats.waiting_tokens + self.stats.running_tokens - self.load_at_stats)

    def kv_used_fraction(self) -> float | None:
        if self.stats is None or not self.stats.num_kv_blocks:
            return None
        return self.stats.used_kv_blocks / self.stats.num_kv_blocks


class ReplicaSet:
    def __init__(self, replicas: list[Replica], failover_seconds: float = DEFAULTS["replica_failover_seconds"]):
        if not replicas:
            raise ValueError("at least one replica")
        self.replicas = replicas
        self.failover_seconds = failover_seconds
        self.router = Router(block_size=16)  # its block size is the model's, once known
        self.resumed_total = 0
        self._model: generate_pb2.ModelInfo | None = None
        self._on_serving = None
        self._serving: bool | None = None
        self._health_updates: set[asyncio.Task] = set()  # (the loop keeps only weak references)

    @classmethod
    def connect(cls, addresses: Sequence[str], token: str | None, **kw) -> ReplicaSet:
        """Replicas at the schedulers' addresses, over channels carrying the cluster token."""
        replicas = []
        for i, address in enumerate(addresses):
            channel = aio_channel(address, token, intercept_streams=False)
            stub = engine_pb2_grpc.SchedulerStub(channel)
            replicas.append(Replica(i, address, stub, channel, session=SchedulerSession(stub, bearer(token))))
        return cls(replicas, **kw)

    @classmethod
    def single(cls, stub) -> ReplicaSet:
        """One scheduler stub, taken as always up (tests, embedders without health)."""
        return cls([Replica(0, "", stub, up=True)])

    def __len__(self) -> int:
        return len(self.replicas)

    async def close(self) -> None:
        for r in self.replicas:
            if r.session is not None:
                await r.session.close()
            if r.channel is not None:
                await r.channel.close()

    # ------------------------------------------------------------------ the model

    async def model_info(self) -> generate_pb2.ModelInfo:
        """The model served, from the first replica that answers (up ones first); raises the last
        replica's AioRpcError when none does."""
        if self._model is not None:
            return self._model
        error = None
        for r in sorted(self.replicas, key=lambda r: not r.up):
            try:
                info = await r.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=30)
            except grpc.aio.AioRpcError as e:
                error = e
                continue
            self._model = info
            self.router.block_size = info.block_size or self.router.block_size
            self._admit(r, info)
            return info
        raise error

    def _admit(self, replica: Replica, info: generate_pb2.ModelInfo) -> bool:
        """Whether the replica serves the model (the first one's); it is refused if not."""
        replica.info = info
        model = self._model
        differ = [f for f in SAME_MODEL_FIELDS if model is not None and getattr(info, f) != getattr(model, f)]
        if differ:
            if not replica.refused:
                log.error(
                    "replica %d (%s) serves another model (%s differ): refused",
                    replica.index,
                    replica.address,
                    ", ".join(differ),
                )
            replica.refused = ", ".join(differ)
            return False
        replica.refused = ""
        return True

    def describe(self, info: generate_pb2.ModelInfo) -> generate_pb2.ModelInfo:
        """GetModelInfo: the model, and each replica as this gateway sees it."""
        out = generate_pb2.ModelInfo()
        out.CopyFrom(info)
        out.data_parallel_size = len(self.replicas)
        for r in self.replicas:
            stats = r.stats
            out.replicas.add(
                index=r.index,
                address=r.address,
                up=r.up,
                pipeline_stages=r.info.pipeline_stages if r.info else 0,
                num_kv_blocks=r.info.num_kv_blocks if r.info else 0,
                running=stats.running if stats else 0,
                waiting=stats.waiting if stats else 0,
                load_tokens=max(r.load_tokens, 0),
                routed=sum(r.routed.values()),
                resumed=r.resumed,
            )
        return out

    # ------------------------------------------------------------------ routing

    def loads(self) -> list[float | None]:
        now = time.monotonic()
        return [
            effective_load(r.load_tokens, r.others_tokens(now), r.kv_used_fraction()) if r.up else None
            for r in self.replicas
        ]

    def route(self, prompt: Sequence[int], cost: int, group: bool = False) -> Route:
        """Where a request (its n children, `cost` tokens in all) or a prefix group (`prompt` its
        prefix) runs. With no replica up, the least loaded (its Submit says why it cannot serve)."""
        index, reason = self.router.choose(prompt, cost, self.loads())
        if index is None:
            index = min(range(len(self.replicas)), key=lambda i: self.replicas[i].load_tokens)
        if group and reason == LOAD:
            reason = GROUP
        replica = self.replicas[index]
        replica.routed[reason] += 1
        return Route(self, replica, prompt, cost)

    def replacement(self, route: Route, lost: Replica) -> Replica | None:
        """Where a route leaving `lost` goes: the router's choice among the others that are up."""
        index, _ = self.router.choose(route.prompt, route.cost, self.loads(), exclude=lost.index)
        if index is None:
            return None
        self.replicas[index].routed[RESUME] += 1
        return self.replicas[index]

    def resumed(self, replica: Replica, call) -> None:
        replica.resumed += 1
        self.resumed_total += 1
        log.info(
            "child %s resumes on replica %d after %d token(s)", call.child.request_id, replica.index, len(call.received)
        )

    # ------------------------------------------------------------------ health

    def mark_down(self, replica: Replica, why: str = "") -> None:
        """The replica cannot serve now (a call failed with UNAVAILABLE): no request goes there
        until its health check says SERVING again."""
        if replica.channel is None:
            return  # a handed-in stub has no health to come back by
        self._set_up(replica, False, why)

    def _set_up(self, replica: Replica, up: bool, why: str = "") -> None:
        if up == replica.up and (up or replica.down_since is not None):
            return
        starting = not up and not replica.up  # never up yet: still starting
        replica.up = up
        replica.down_since = None if up else time.monotonic()
        if not up:
            self.router.index.forget(replica.index)  # its prefix cache is gone or going
        log.log(
            logging.INFO if up or starting else logging.WARNING,
            "replica %d (%s) %s%s",
            replica.index,
            replica.address,
            "serving" if up else "not serving yet" if starting else "NOT serving",
            f": {why}" if why else "",
        )
        self._notify()

    def _notify(self) -> None:
        serving = any(r.up for r in self.replicas)
        if serving != self._serving and self._on_serving is not None:
            self._serving = serving
            task = asyncio.get_running_loop().create_task(self._on_serving(serving))
            self._health_updates.add(task)
            task.add_done_callback(self._health_updates.discard)

    async def follow(self, on_serving) -> None:
        """Until cancelled: each replica's health (on_serving(bool) when the gateway's own should
        change: SERVING while any replica is up), its statistics with several replicas, and the
        failover of a replica down past the grace period."""
        self._on_serving = on_serving
        self._serving = None
        self._notify()
        tasks = [asyncio.create_task(self._follow(r), name=f"replica-{r.index}") for r in self.replicas if r.channel]
        if len(self.replicas) > 1:
            tasks.append(asyncio.create_task(self._poll_stats(), name="replica-stats"))
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()

    async def _follow(self, replica: Replica) -> None:
        stub = health_pb2_grpc.HealthStub(replica.channel)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=HEALTH_INTERVAL)
                serving = reply.status == health_pb2.HealthCheckResponse.SERVING
            except grpc.aio.AioRpcError:
                serving = False
            if serving and not replica.up:
                serving = await self._serves_the_model(replica)
            self._set_up(replica, serving)
            if not serving:
                self._fail_over_if_overdue(replica)
            await asyncio.sleep(HEALTH_INTERVAL)

    async def _serves_the_model(self, replica: Replica) -> bool:
        try:
            info = await replica.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=HEALTH_INTERVAL)
        except grpc.aio.AioRpcError:
            return False
        if self._model is None:
            self._model = info
            self.router.block_size = info.block_size or self.router.block_size
        return self._admit(replica, info)

    def _fail_over_if_overdue(self, replica: Replica) -> None:
        """Past the grace period, the requests a replica holds while it rebuilds move elsewhere."""
        since = replica.down_since
        if since is None or not replica.calls or time.monotonic() - since < self.failover_seconds:
            return
        routes = {call.route for call in replica.calls}
        moved = sum(route.move_from(replica) for route in routes)
        if moved:
            log.warning(
                "replica %d down for %.0f s: %d request(s) move to other replicas",
                replica.index,
                time.monotonic() - since,
                moved,
            )

    async def _poll_stats(self) -> None:
        request = engine_pb2.GetStatsRequest()

        async def poll(r: Replica) -> None:
            try:
                r.stats = await r.stub.GetStats(request, timeout=STATS_INTERVAL * 2)
                r.stats_at, r.load_at_stats = time.monotonic(), r.load_tokens
            except grpc.aio.AioRpcError:
                pass

        while True:
            await asyncio.gather(*(poll(r) for r in self.replicas if r.up))
            await asyncio.sleep(STATS_INTERVAL)

    async def probe(self, timeout: float = 2.0) -> grpc.aio.AioRpcError | None:
        """None when some replica's scheduler answers (HTTP /health), else the last error."""
        error = None
        for r in sorted(self.replicas, key=lambda r: not r.up):
            try:
                await r.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=timeout)
                return None
            except grpc.aio.AioRpcError as e:
                error = e
        return error

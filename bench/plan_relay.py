"""How rank 0 of a tensor-parallel stage hands each plan to its peers: the relay's cost, per plan
size, through what serving uses (a gRPC Steps stream, the plan's bytes written as they came:
tensor_parallel/relay.py) against a length-framed TCP socket (the alternative the relay's
docstring weighs). A peer process receives every plan and stamps its arrival; the figures are
the sender's time in each write (what a coroutine awaits), its process's CPU time per plan (every
thread's: gRPC's own included), and the one-way latency, plan written to plan parsed on the peer
(one host: both read CLOCK_MONOTONIC), median and p99, plans sent one at a time as a scheduler's
come. "grpc+token" is the Steps stream as serving opens it, carrying the cluster token that
`strata serve` always sets.

    python -m strata.bench.plan_relay
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import struct
import time

import numpy as np

SIZES = {"decode, 16 seqs": (16, 1), "decode, 256 seqs": (256, 1), "prefill, 2,048 tokens": (4, 512)}


def _plan(seqs: int, tokens_each: int, step: int) -> bytes:
    from strata.v1 import engine_pb2

    plan = engine_pb2.StepPlan(step_id=step)
    plan.seq_ids.extend(range(seqs))
    plan.num_computed.extend([500] * seqs)
    plan.num_scheduled.extend([tokens_each] * seqs)
    plan.input_token_ids.extend(range(seqs * tokens_each))
    plan.table_keep.extend([32] * seqs)
    plan.table_append_counts.extend([0] * seqs)
    plan.sample.extend([True] * seqs)
    return plan.SerializeToString()


# ------------------------------------------------------------------ the peer


def _peer(kind: str, port_out, stamps_out, count: int) -> None:
    from strata.v1 import engine_pb2

    arrivals = []

    async def grpc_peer():
        import grpc

        from strata.grpc_util import new_server

        done = asyncio.Event()

        async def steps(request_iterator, context):
            async for raw in request_iterator:
                engine_pb2.StepPlan.FromString(raw)
                arrivals.append(time.perf_counter())
                if len(arrivals) == count:
                    done.set()
            return
            yield  # (a stream of results, none here)

        server, _ = new_server()
        handler = grpc.stream_stream_rpc_method_handler(steps, request_deserializer=None, response_serializer=None)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("strata.v1.Worker", {"Steps": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        port_out.put(port)
        await done.wait()
        await server.stop(0.5)

    async def socket_peer():
        done = asyncio.Event()

        async def serve(reader, writer):
            while len(arrivals) < count:
                size = struct.unpack("<I", await reader.readexactly(4))[0]
                engine_pb2.StepPlan.FromString(await reader.readexactly(size))
                arrivals.append(time.perf_counter())
            done.set()

        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        port_out.put(server.sockets[0].getsockname()[1])
        await done.wait()
        server.close()

    asyncio.run(grpc_peer() if kind == "grpc" else socket_peer())
    stamps_out.put(arrivals)


# ------------------------------------------------------------------ rank 0


async def _send_grpc(
    port: int, plans: list[bytes], gap: float, token: str | None = None
) -> tuple[list[float], list[float]]:
    from strata.grpc_util import aio_channel

    sent, loop_time = [], []
    async with aio_channel(f"127.0.0.1:{port}", token) as channel:
        call = channel.stream_stream("/strata.v1.Worker/Steps", request_serializer=None, response_deserializer=None)()
        for raw in plans:
            start = time.perf_counter()
            sent.append(start)
            await call.write(raw)
            loop_time.append(time.perf_counter() - start)
            await asyncio.sleep(gap)
        await call.done_writing()
        await call.wait_for_connection()
    return sent, loop_time


async def _send_socket(port: int, plans: list[bytes], gap: float) -> tuple[list[float], list[float]]:
    sent, loop_time = [], []
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for raw in plans:
        start = time.perf_counter()
        sent.append(start)
        writer.write(struct.pack("<I", len(raw)) + raw)
        await writer.drain()
        loop_time.append(time.perf_counter() - start)
        await asyncio.sleep(gap)
    await asyncio.sleep(0.5)
    writer.close()
    return sent, loop_time


def measure(kind: str, plans: list[bytes], gap: float) -> dict:
    ctx = multiprocessing.get_context("spawn")
    ports, stamps = ctx.Queue(), ctx.Queue()
    peer = ctx.Process(target=_peer, args=(kind.split("+")[0], ports, stamps, len(plans)))
    peer.start()
    port = ports.get(timeout=60)
    send = {
        "grpc": _send_grpc,
        "grpc+token": lambda *args: _send_grpc(*args, token="cluster-token"),
        "socket": _send_socket,
    }[kind]
    cpu = time.process_time()
    sent, loop_time = asyncio.run(send(port, plans, gap))
    cpu = (time.process_time() - cpu) / len(plans)
    arrivals = stamps.get(timeout=120)
    peer.join(30)
    latency = (np.asarray(arrivals) - np.asarray(sent))[5:] * 1e6  # (the first plans open the path)
    loop = np.asarray(loop_time[5:]) * 1e6
    return {
        "latency_p50_us": float(np.percentile(latency, 50)),
        "latency_p99_us": float(np.percentile(latency, 99)),
        "sender_loop_us": float(np.median(loop)),
        "sender_cpu_us": cpu * 1e6,  # every thread of the sender's process, per plan
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m strata.bench.plan_relay", description=__doc__.split("\n\n")[0])
    p.add_argument("--plans", type=int, default=300, help="plans per size and way")
    p.add_argument("--gap-ms", type=float, default=2.0, help="time between plans (a step's)")
    args = p.parse_args(argv)
    print(f"{'plan':>24} {'bytes':>8} {'way':>10} {'p50 us':>8} {'p99 us':>8} {'loop us':>8} {'cpu us':>8}")
    for name, (seqs, tokens) in SIZES.items():
        plans = [_plan(seqs, tokens, i) for i in range(args.plans)]
        for kind in ("grpc", "grpc+token", "socket"):
            r = measure(kind, plans, args.gap_ms / 1e3)
            print(
                f"{name:>24} {len(plans[0]):>8,} {kind:>10} {r['latency_p50_us']:>8.0f} "
                f"{r['latency_p99_us']:>8.0f} {r['sender_loop_us']:>8.1f} {r['sender_cpu_us']:>8.1f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

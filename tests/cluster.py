"""Test helpers: start a real local cluster (separate processes) and an HF oracle."""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import torch

from strata.cli import build_parser
from strata.client import StrataClient
from strata.grpc_util import bearer
from strata.launcher import free_port, start_cluster
from strata.v1 import engine_pb2, engine_pb2_grpc, generate_pb2

# Clusters that tests of several modules share, by (model directory, stages, flags); stopped at
# the end of the session (tests/conftest.py).
_SHARED: dict[tuple, tuple[contextlib.ExitStack, object, StrataClient]] = {}
# Tiny models that several modules share (their clusters too), by (seed, layers, arch).
_SHARED_MODELS: dict[tuple, Path] = {}


def shared_cluster(model_dir: Path | str, stages: int = 1, *extra: str):
    """(cluster, client) of running_cluster(model_dir, stages, *extra), shared by every test of the
    session that asks for the same one: each cluster start costs 7-10 s on two cores. A cluster a
    test left with a service down is replaced. Its counters add up over the tests that share it."""
    key = (str(model_dir), stages, extra)
    entry = _SHARED.get(key)
    if entry is not None and any(proc.poll() is not None for _, proc in entry[1].procs):
        _SHARED.pop(key)[0].close()
        entry = None
    if entry is None:
        stack = contextlib.ExitStack()
        cluster, client = stack.enter_context(running_cluster(model_dir, stages, *extra))
        entry = _SHARED[key] = (stack, cluster, client)
    return entry[1], entry[2]


def stop_shared_clusters() -> None:
    while _SHARED:
        _SHARED.popitem()[1][0].close()


@contextlib.contextmanager
def running_cluster(model_dir: Path | str, stages: int = 1, *extra: str):
    args = build_parser().parse_args(
        [
            "serve",
            "--model",
            str(model_dir),
            "--pipeline-stages",
            str(stages),
            "--port",
            str(free_port()),
            "--http-port",
            str(free_port()),
            "--device",
            "cpu",
            "--block-size",
            "4",
            *extra,
        ]
    )
    cluster = start_cluster(args, startup_timeout=180)
    client = StrataClient(cluster.gateway_address)
    try:
        yield cluster, client
    finally:
        client.close()
        cluster.stop()


def scheduler_stats(cluster) -> engine_pb2.SchedulerStats:
    with grpc.insecure_channel(cluster.scheduler_address) as ch:
        return engine_pb2_grpc.SchedulerStub(ch).GetStats(
            engine_pb2.GetStatsRequest(), timeout=10, metadata=bearer(cluster.cluster_token)
        )


def worker_calls(cluster, method: str, request) -> list:
    """One Worker RPC (Describe, GetStats, ...) on every stage of a running cluster, in stage order."""
    out = []
    for address in cluster.worker_addresses:
        with grpc.insecure_channel(address) as ch:
            call = getattr(engine_pb2_grpc.WorkerStub(ch), method)
            out.append(call(request, timeout=10, metadata=bearer(cluster.cluster_token)))
    return out


def hf_greedy(model_dir: Path | str, prompts: list[list[int]], max_new_tokens: list[int]) -> list[list[int]]:
    """HF transformers generate(), greedy, float32, one prompt at a time (no padding effects)."""
    from tests.tiny_models import load_hf_model

    model = load_hf_model(model_dir)
    model.generation_config.eos_token_id = None  # compared with ignore_eos=True
    outs = []
    with torch.inference_mode():
        for prompt, n in zip(prompts, max_new_tokens):
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                pad_token_id=0,
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return outs


def collect(responses) -> dict[int, list[int]]:
    """Token ids per output index from a stream of DELTA or CUMULATIVE responses."""
    tokens: dict[int, list[int]] = {}
    for r in responses:
        for o in r.outputs:
            tokens.setdefault(o.index, []).extend(o.token_ids)
    return tokens


def greedy_concurrently(client, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Each prompt's greedy tokens (lengths[i] of them, ignore_eos), every request in flight at
    once through the public gRPC API, streamed as DELTA responses."""

    def one(i):
        stream = client.generate(
            prompts[i],
            max_tokens=lengths[i],
            temperature=0.0,
            ignore_eos=True,
            output_kind=generate_pb2.DELTA,
            timeout=300,
        )
        return collect(stream)[0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, range(len(prompts))))


def tiny_llama_dir(tmp_path_factory, seed: int, layers: int = 2, arch: str = "llama", shared: bool = False) -> Path:
    """A tiny random HF model with its own BPE tokenizer, written once per test module; `shared`:
    once per session, for the modules that share its clusters (shared_cluster)."""
    from strata.default_model import build_tiny_tokenizer
    from tests.tiny_models import write_tiny_model

    if shared and (seed, layers, arch) in _SHARED_MODELS:
        return _SHARED_MODELS[seed, layers, arch]
    tok = build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=384)
    path = write_tiny_model(
        tmp_path_factory.mktemp(arch), arch=arch, seed=seed, tokenizer=tok, num_hidden_layers=layers
    )
    if shared:
        _SHARED_MODELS[seed, layers, arch] = path
    return path


def mixed_requests(max_tokens: int) -> list[tuple[str, dict]]:
    """16 streamed requests, greedy and seeded sampled, some with n = 2: what the fault tests
    (a lost stage, a lost replica) run through a failure and compare token for token."""
    out = []
    for i in range(16):
        kw = dict(max_tokens=max_tokens, ignore_eos=True, output_kind=generate_pb2.DELTA)
        kw.update(temperature=0.0) if i % 2 else kw.update(temperature=0.9, top_p=0.95, seed=1000 + i)
        if i % 4 == 1:
            kw.update(n=2, temperature=0.8, seed=50 + i)
        out.append((f"request {i} " * (1 + i % 3), kw))
    return out


def run_all(client, work, started: threading.Barrier | None = None):
    """Starts every request of `work` on a thread of its own: (threads, results, errors), filled
    as they end (collect()'s tokens by output index; the gRPC status code of a failed one).
    started: each waits there once its first response came (a fault then hits them mid-stream)."""
    results, errors = {}, {}

    def one(i, prompt, kw):
        try:
            stream = client.generate(prompt, timeout=300, **kw)
            first = next(stream)
            if started is not None:
                started.wait()
            results[i] = collect([first, *stream])
        except grpc.RpcError as e:
            errors[i] = e.code()

    threads = [threading.Thread(target=one, args=(i, p, kw)) for i, (p, kw) in enumerate(work)]
    for t in threads:
        t.start()
    return threads, results, errors

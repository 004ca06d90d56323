"""Start a cluster, send a burst of concurrent requests, print the first failure's status in full.

python -m strata.bench.smoke --model dummy:llama-3.2-1b --requests 64 --input-len 64 --output-len 32
"""

from __future__ import annotations

import argparse
import random
from concurrent.futures import ThreadPoolExecutor

import grpc

from strata.client import StrataClient
from strata.flags import service_args
from strata.launcher import free_port, start_cluster
from strata.v1 import generate_pb2


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="dummy:llama-3.2-1b")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--stages", type=int, default=1)
    p.add_argument("extra", nargs="*", help="more `strata serve` flags")
    a = p.parse_args()
    args = service_args(
        [
            "serve",
            "--model",
            a.model,
            "--http-port",
            "0",
            "--pipeline-stages",
            str(a.stages),
            "--port",
            str(free_port()),
            *a.extra,
        ]
    )
    cluster = start_cluster(args)
    try:
        client = StrataClient(cluster.gateway_address)
        vocab = client.model_info().vocab_size
        rng = random.Random(0)
        prompts = [[rng.randrange(vocab) for _ in range(a.input_len)] for _ in range(a.requests)]

        def one(prompt):
            try:
                final = list(
                    client.generate(
                        prompt,
                        max_tokens=a.output_len,
                        ignore_eos=True,
                        output_kind=generate_pb2.FINAL_ONLY,
                        timeout=300,
                    )
                )
                return len(final[-1].outputs[0].token_ids), None
            except grpc.RpcError as e:
                return 0, f"{e.code().name}: {e.details()}"

        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(one, prompts))
        errors = [e for _, e in results if e]
        print(f"{len(results) - len(errors)} ok, {len(errors)} failed; tokens {sum(n for n, _ in results)}")
        if errors:
            print("first error:", errors[0])
        return 1 if errors else 0
    finally:
        cluster.stop()


if __name__ == "__main__":
    raise SystemExit(main())

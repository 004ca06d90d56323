"""The project's own clients reach a TLS gateway that requires an API key: `strata generate` and
StrataClient with --tls-ca and --api-key; a plaintext or unauthenticated client is refused. The
gateway serves the model under --served-model-name."""

from __future__ import annotations

import subprocess
import sys
import time

import grpc
import pytest

from strata.client import StrataClient
from strata.v1 import generate_pb2
from tests.cluster import collect, running_cluster, tiny_llama_dir

API_KEY = "sk-test-tls"


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1 (its own CA)."""
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-keyout",
            str(d / "key.pem"),
            "-out",
            str(d / "cert.pem"),
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    return d / "cert.pem", d / "key.pem"


def _wait_ready(client: StrataClient, timeout: float = 60.0) -> None:
    """start_cluster cannot probe a TLS gateway's health: ask until the model answers."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.model_info()
            return
        except grpc.RpcError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


def test_clients_reach_a_tls_gateway_with_their_ca_and_key(tmp_path_factory, certificate):
    cert, key = certificate
    model = tiny_llama_dir(tmp_path_factory, seed=41)
    with running_cluster(
        model,
        1,
        "--tls-cert",
        str(cert),
        "--tls-key",
        str(key),
        "--api-key",
        API_KEY,
        "--served-model-name",
        "team/tls-model",
    ) as (cluster, _):
        client = StrataClient(cluster.gateway_address, api_key=API_KEY, tls_ca=str(cert))
        try:
            _wait_ready(client)
            assert client.model_info().model_name == "team/tls-model"
            out = collect(
                client.generate(
                    [3, 4, 5],
                    max_tokens=5,
                    temperature=0.0,
                    ignore_eos=True,
                    output_kind=generate_pb2.DELTA,
                    timeout=60,
                )
            )
            assert len(out[0]) == 5
        finally:
            client.close()

        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "strata.cli",
                "generate",
                "once upon",
                "--address",
                cluster.gateway_address,
                "--tls-ca",
                str(cert),
                "--api-key",
                API_KEY,
                "--max-tokens",
                "4",
                "--temperature",
                "0",
                "--ignore-eos",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert cli.returncode == 0, cli.stderr
        assert cli.stdout.strip()

        no_key = StrataClient(cluster.gateway_address, tls_ca=str(cert))
        plaintext = StrataClient(cluster.gateway_address, api_key=API_KEY)
        try:
            with pytest.raises(grpc.RpcError) as err:
                list(no_key.generate("hi", max_tokens=2, timeout=30))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                list(plaintext.generate("hi", max_tokens=2, timeout=10))
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            no_key.close()
            plaintext.close()

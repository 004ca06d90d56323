"""A small Python client for the Gateway service, and `strata generate`."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import grpc

from strata import openai_format
from strata.grpc_util import CHANNEL_OPTIONS
from strata.prompt_tokens import PromptInput, to_proto
from strata.v1 import generate_pb2, generate_pb2_grpc


def gateway_channel(address: str, tls_ca: str | None = None) -> grpc.Channel:
    """A channel to a gateway: TLS verified against the CA bundle `tls_ca` when given."""
    if tls_ca:
        credentials = grpc.ssl_channel_credentials(root_certificates=open(tls_ca, "rb").read())
        return grpc.secure_channel(address, credentials, options=CHANNEL_OPTIONS)
    return grpc.insecure_channel(address, options=CHANNEL_OPTIONS)


class StrataClient:
    def __init__(self, address: str = "127.0.0.1:50051", api_key: str | None = None, tls_ca: str | None = None):
        self.channel = gateway_channel(address, tls_ca)
        self.stub = generate_pb2_grpc.GatewayStub(self.channel)
        self.metadata = [("authorization", f"Bearer {api_key}")] if api_key else None

    def generate(
        self, prompt: str | list[int], timeout: float = 600.0, request_id: str = "", **params
    ) -> Iterator[generate_pb2.GenerateResponse]:
        """Streams responses; `params` are SamplingParams fields (max_tokens=..., temperature=...)."""
        req = generate_pb2.GenerateRequest(request_id=request_id, params=generate_pb2.SamplingParams(**params))
        if isinstance(prompt, str):
            req.prompt = prompt
        else:
            req.prompt_token_ids.ids.extend(prompt)
        return self.stub.Generate(req, timeout=timeout, metadata=self.metadata)

    def tokenize(
        self,
        prompt: str | list[dict],
        add_special_tokens: bool | None = None,
        add_generation_prompt: bool = True,
        timeout: float = 30.0,
    ) -> generate_pb2.TokenizeResponse:
        """The ids Generate runs on for a prompt's text, or for chat messages ({"role", "content"},
        content a string or OpenAI's text parts) as /v1/chat/completions formats them."""
        if isinstance(prompt, str):
            request = to_proto(PromptInput(text=prompt, add_special_tokens=add_special_tokens))
        else:
            messages = openai_format.chat_messages(prompt)
            request = to_proto(PromptInput(None, messages, add_special_tokens, add_generation_prompt))
        return self.stub.Tokenize(request, timeout=timeout, metadata=self.metadata)

    def detokenize(self, ids: list[int], timeout: float = 30.0) -> str:
        request = generate_pb2.DetokenizeRequest(tokens=ids)
        return self.stub.Detokenize(request, timeout=timeout, metadata=self.metadata).prompt

    def model_info(self, timeout: float = 30.0) -> generate_pb2.ModelInfo:
        return self.stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()


def generate_cli(args) -> int:
    client = StrataClient(args.address, args.api_key, args.tls_ca)
    params = dict(
        max_tokens=args.max_tokens,
        n=args.n,
        top_k=args.top_k,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        output_kind=generate_pb2.DELTA,
    )
    for name in ("temperature", "top_p", "seed"):
        if getattr(args, name) is not None:
            params[name] = getattr(args, name)
    try:
        for response in client.generate(args.prompt, timeout=args.timeout, **params):
            for out in response.outputs:
                prefix = f"[{out.index}] " if args.n > 1 else ""
                sys.stdout.write(prefix + out.text if args.n > 1 and out.text else out.text)
                if out.finish_reason and args.n > 1:
                    sys.stdout.write(f"  <{out.finish_reason}>\n")
            sys.stdout.flush()
            if response.finished:
                u = response.usage
                print(f"\n[{u.prompt_tokens} prompt tokens, {u.completion_tokens} completion tokens]", file=sys.stderr)
    except grpc.RpcError as e:
        print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0

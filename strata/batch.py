"""`strata batch INPUT.jsonl OUTPUT.jsonl`: an offline batch in OpenAI's batch file format.

Each input line is {"custom_id", "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body"} (the format `vllm run-batch` reads); each output line is
{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}. The prompts'
shared prefixes are found over token ids (sorted, then the longest common prefix of neighbours,
as BatchLLM does) and sent as prefix groups (Gateway.GenerateGroups), so each prefix is computed
once. A bad line gets an error line and the rest run. Output lines are written as requests
finish; run again after an interruption, it skips the custom_ids OUTPUT already answers, so
nothing finished is lost or done twice.

Against a running gateway (--address) the prompts are tokenized by the gateway itself
(Gateway.TokenizeBatch, in chunks, a few calls in flight), so prefixes are found over exactly the
served model's ids. A local --tokenizer is a shortcut that must first tokenize a few probes as the
gateway does; the batch refuses to run on a mismatch, before any request is sent.
"""

from __future__ import annotations

import json
import os
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from strata import openai_format, openai_prompts, openai_responses
from strata.batch_tokenize import GatewayTokenizer, TokenizerMismatch, check_tokenizer
from strata.client import gateway_channel
from strata.common_prefix import sort_by_prefix
from strata.prompt_tokens import ChatTemplateError, PromptInput, token_ids
from strata.v1 import generate_pb2, generate_pb2_grpc

# Shorter shared prefixes are not worth a group (a block or two of KV).
MIN_SHARED_PREFIX = 32
MAX_GROUP_MEMBERS = 256


@dataclass
class Item:
    custom_id: str
    chat: bool
    prompt: list[int]
    params: generate_pb2.SamplingParams
    echo: openai_prompts.Echo | None = None
    text: str | None = None  # the prompt's text, when the line gave one (an echo's)


@dataclass
class Entry:
    """A line read, its prompt not tokenized yet (token ids given in the line pass through)."""

    custom_id: str
    line: int
    chat: bool
    prompt: PromptInput | list[int]
    params: generate_pb2.SamplingParams
    echo: openai_prompts.Echo | None = None


# Tokenizes prompts: each one's ids, or the message that refuses it.
Tokenize = Callable[[list[PromptInput]], list[list[int] | str]]


def read_items(path: Path, done: set[str], tokenize: Tokenize, max_model_len: int) -> tuple[list[Item], list[dict]]:
    """The input's requests not answered yet, tokenized, and error lines for the bad ones."""
    entries, errors = read_entries(path, done)
    texts = [e.prompt for e in entries if isinstance(e.prompt, PromptInput)]
    tokenized = iter(tokenize(texts))
    items = []
    for entry in entries:
        prompt = entry.prompt if isinstance(entry.prompt, list) else next(tokenized)
        if isinstance(prompt, str):
            errors.append(error_line(entry.custom_id, 400, f"line {entry.line}: {prompt}"))
            continue
        if entry.chat and not entry.params.HasField("max_tokens") and len(prompt) < max_model_len:
            entry.params.max_tokens = max_model_len - len(prompt)  # a chat answer may fill the context
        text = entry.prompt.text if isinstance(entry.prompt, PromptInput) else None
        items.append(Item(entry.custom_id, entry.chat, prompt, entry.params, entry.echo, text))
    return items, errors


def read_entries(path: Path, done: set[str]) -> tuple[list[Entry], list[dict]]:
    """The input's lines not answered yet, parsed, and error lines for the bad ones."""
    entries, errors, seen = [], [], set(done)
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            key = f"line-{number}"  # what an error line of a line without a custom_id is called
            try:
                entry = json.loads(line)
                custom_id = entry.get("custom_id") if isinstance(entry, dict) else None
                if isinstance(custom_id, str) and custom_id:
                    key = custom_id
                if key in done:
                    continue  # answered by an earlier run
                if not isinstance(entry, dict):
                    raise openai_format.BadField("line", "must be a JSON object")
                if key != custom_id:
                    raise openai_format.BadField("custom_id", "must be a non-empty string")
                if key in seen:
                    raise openai_format.BadField("custom_id", f"{key!r} appears twice")
                seen.add(key)
                entries.append(_entry(entry, key, number))
            except json.JSONDecodeError as e:
                if key not in done:
                    errors.append(error_line(key, 400, f"line {number}: not JSON: {e}"))
            except openai_format.BadField as e:
                errors.append(error_line(key, 400, f"line {number}: {e}"))
    return entries, errors


def _entry(entry: dict, custom_id: str, line: int) -> Entry:
    url = entry.get("url")
    if url not in (openai_format.COMPLETIONS, openai_format.CHAT_COMPLETIONS):
        raise openai_format.BadField("url", f"must be {openai_format.COMPLETIONS} or {openai_format.CHAT_COMPLETIONS}")
    if entry.get("method", "POST") != "POST":
        raise openai_format.BadField("method", "must be POST")
    body = entry.get("body")
    if not isinstance(body, dict):
        raise openai_format.BadField("body", "must be an object")
    if body.get("stream"):
        raise openai_format.BadField("body.stream", "a batch request cannot stream")
    chat = url == openai_format.CHAT_COMPLETIONS
    prompt = openai_format.prompt_input(body, chat)
    params = openai_format.sampling_params(body, chat)
    return Entry(custom_id, line, chat, prompt, params, openai_prompts.echo_of(body, chat))


def local_tokenize(tokenizer) -> Tokenize:
    """Tokenizes with a local tokenizer, through the gateway's own function (prompt_tokens)."""

    def tokenize(prompts: list[PromptInput]) -> list[list[int] | str]:
        out: list[list[int] | str] = []
        for prompt in prompts:
            try:
                out.append(token_ids(tokenizer, prompt))
            except ChatTemplateError as e:
                out.append(f"messages: {e}")
        return out

    return tokenize


def shared_prefix_groups(items: list[Item]) -> list[tuple[int, list[Item]]]:
    """(shared prefix length, members) groups: prompts sorted by token ids, then runs of
    neighbours whose common prefix stays >= MIN_SHARED_PREFIX (the run's prefix is the least
    common prefix in it). Every member keeps at least one token of its own."""
    order, neighbours = sort_by_prefix(items, key=lambda item: item.prompt)
    groups: list[tuple[int, list[Item]]] = []
    members: list[Item] = []
    prefix = 0
    for i, item in enumerate(order):
        if members:  # members[-1] is order[i - 1]
            common = min(prefix, neighbours[i - 1], len(item.prompt) - 1)
            if common >= MIN_SHARED_PREFIX and len(members) < MAX_GROUP_MEMBERS:
                members.append(item)
                prefix = common
                continue
            groups.append((prefix if len(members) > 1 else 0, members))
        members, prefix = [item], len(item.prompt) - 1
    if members:
        groups.append((prefix if len(members) > 1 else 0, members))
    return groups


def group_messages(groups: list[tuple[int, list[Item]]]):
    for prefix, members in groups:
        shared = members[0].prompt[:prefix]
        yield generate_pb2.PrefixGroup(
            prefix_token_ids=generate_pb2.TokenIds(ids=shared),
            members=[
                generate_pb2.GenerateRequest(
                    request_id=m.custom_id,
                    params=m.params,
                    prompt_token_ids=generate_pb2.TokenIds(ids=m.prompt[prefix:]),
                )
                for m in members
            ],
        )


def answer_line(
    item: Item, response: generate_pb2.GenerateResponse, model: str, token_text=None, detokenize=None
) -> dict:
    """token_text(id): a token's text for logprobs (None without a tokenizer: the token texts
    of logprobs stay out); detokenize(ids): an echoed token id prompt's text."""
    text = item.text
    if text is None and item.echo is not None and detokenize is not None:
        text = detokenize(item.prompt)
    view = openai_prompts.PromptView(text or "", item.echo)
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": item.custom_id,
        "response": {
            "status_code": 200,
            "request_id": response.request_id,
            "body": openai_responses.response_body(response, item.chat, model, token_text, view),
        },
        "error": None,
    }


def error_line(custom_id: str, status: int, message: str) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"code": str(status), "message": message},
    }


def answered(path: Path) -> set[str]:
    """custom_ids that OUTPUT already holds a complete line for (a torn last line is dropped)."""
    if not path.exists():
        return set()
    done, good = set(), 0
    with open(path, "rb") as f:
        for line in f:
            try:
                done.add(json.loads(line)["custom_id"])
                good += len(line)
            except (json.JSONDecodeError, KeyError, TypeError):
                break
    if good < path.stat().st_size:  # an interrupted write: keep only whole lines
        with open(path, "rb+") as f:
            f.truncate(good)
    return done


# HTTP-like status of a gRPC failure, for error lines.
_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT.value[0]: 400,
    grpc.StatusCode.UNAUTHENTICATED.value[0]: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]: 429,
    grpc.StatusCode.UNAVAILABLE.value[0]: 503,
}


def run_batch(
    input_path: Path,
    output_path: Path,
    address: str,
    tokenizer=None,
    api_key: str | None = None,
    progress: bool = True,
    timeout: float = 7 * 24 * 3600.0,
    tls_ca: str | None = None,
) -> int:
    """Runs the batch against the gateway at `address`; returns the number of error lines.
    Without `tokenizer` the gateway tokenizes; with one, it is checked against the gateway first
    (TokenizerMismatch before any request is sent)."""
    from tqdm import tqdm

    metadata = [("authorization", f"Bearer {api_key}")] if api_key else None
    done = answered(output_path)
    with gateway_channel(address, tls_ca) as channel:
        stub = generate_pb2_grpc.GatewayStub(channel)
        info = stub.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=60, metadata=metadata)
        tokenize: Tokenize = GatewayTokenizer(stub, metadata)
        if tokenizer is not None:
            local = local_tokenize(tokenizer)
            check_tokenizer(local, tokenize, tokenizer.name_or_path, info.model_name)
            tokenize = local
        items, errors = read_items(input_path, done, tokenize, info.max_model_len)
        by_id = {item.custom_id: item for item in items}
        texts = _token_texts(stub, metadata, tokenizer)
        with (
            open(output_path, "a", encoding="utf-8") as out,
            tqdm(total=len(items) + len(errors), desc="batch", unit="req", disable=not progress) as bar,
        ):

            def write(line: dict) -> None:
                out.write(json.dumps(line, ensure_ascii=False) + "\n")
                out.flush()  # a finished answer survives an interruption
                bar.update(1)

            for line in errors:
                write(line)
            failed = len(errors)
            if items:
                calls = stub.GenerateGroups(
                    group_messages(shared_prefix_groups(items)), timeout=timeout, metadata=metadata
                )
                for r in calls:
                    if r.HasField("error"):
                        failed += 1
                        write(error_line(r.error.request_id, _STATUS.get(r.error.code, 500), r.error.message))
                    elif r.response.finished:
                        write(answer_line(by_id[r.response.request_id], r.response, info.model_name, *texts))
    return failed


def _token_texts(stub, metadata, tokenizer):
    """(token_text, detokenize) for the answers: a token's text from the local tokenizer (None
    without one), and a prompt's text from it or from the gateway."""
    if tokenizer is not None:
        cache: dict[int, str] = {}

        def token_text(token_id: int) -> str:
            if token_id not in cache:
                cache[token_id] = tokenizer.decode([token_id])
            return cache[token_id]

        return token_text, tokenizer.decode

    def detokenize(ids: list[int]) -> str:
        return stub.Detokenize(generate_pb2.DetokenizeRequest(tokens=ids), timeout=60, metadata=metadata).prompt

    return None, detokenize


def batch_cli(args) -> int:
    input_path, output_path = Path(args.input), Path(args.output)
    if not input_path.is_file():
        print(f"error: {input_path} is not a file", file=sys.stderr)
        return 2
    progress = not args.no_progress
    try:
        if args.address:
            if args.model:
                print(
                    "error: --model starts a local cluster; with --address the gateway's model is used "
                    "(--tokenizer DIR tokenizes locally, once checked against it)",
                    file=sys.stderr,
                )
                return 2
            shaped = [
                f for f in ("data_parallel_size", "pipeline_stages", "tensor_parallel_size") if getattr(args, f) != 1
            ]
            if shaped:
                flags = ", ".join("--" + f.replace("_", "-") for f in shaped)
                print(f"error: {flags} shape a local cluster; with --address the gateway's is used", file=sys.stderr)
                return 2
            tokenizer = _load_tokenizer(args.tokenizer) if args.tokenizer else None
            failed = run_batch(
                input_path, output_path, args.address, tokenizer, args.api_key, progress, tls_ca=args.tls_ca
            )
        else:
            from strata.model_source import resolve_model

            model_dir = args.tokenizer or resolve_model(args.model)[0]
            if model_dir is None:
                print("error: the batch needs a tokenizer: --model DIR or --tokenizer DIR", file=sys.stderr)
                return 2
            failed = _with_local_cluster(args, input_path, output_path, _load_tokenizer(model_dir), progress)
    except TokenizerMismatch as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{output_path}: done, {failed} error line(s)", file=sys.stderr)
    return 0


def _load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _with_local_cluster(args, input_path: Path, output_path: Path, tokenizer, progress: bool) -> int:
    """Starts a cluster from --model the way `strata bench` does, runs the batch, stops it."""
    from strata.flags import service_args
    from strata.launcher import free_port, start_cluster

    argv = [
        "serve",
        "--port",
        str(free_port()),
        "--http-port",
        "0",
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
        "--device",
        args.device,
        "--data-parallel-size",
        str(args.data_parallel_size),
        "--pipeline-stages",
        str(args.pipeline_stages),
        "--tensor-parallel-size",
        str(args.tensor_parallel_size),
    ]
    if args.model:
        argv += ["--model", args.model]
    env_before = os.environ.get("STRATA_LOG_LEVEL")
    os.environ["STRATA_LOG_LEVEL"] = env_before or "WARNING"
    try:
        cluster = start_cluster(service_args(argv))
    finally:
        if env_before is None:
            os.environ.pop("STRATA_LOG_LEVEL", None)
    try:
        return run_batch(input_path, output_path, cluster.gateway_address, tokenizer, None, progress)
    finally:
        cluster.stop()

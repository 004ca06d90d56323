"""Qwen3, Gemma 3, Qwen3-MoE and Mixtral through gateway -> scheduler -> workers, on tiny float32
models: greedy equals HF generate() token for token at 1, 2 and 3 stages; seeded sampling and
n > 1 give the same tokens on any number of stages, with n-gram speculation and with a draft made
of the target's first layers; prefix groups give every member the tokens it gets alone (cascade
attention on Gemma's global layers, none on its sliding ones); a JSON schema holds on a mixture
of experts. tests/test_model_families.py checks every architecture at every split in-process.
"""

from __future__ import annotations

import contextlib
import json
import random

import pytest

from strata.default_model import build_tiny_tokenizer
from strata.v1 import generate_pb2
from tests.cluster import collect, greedy_concurrently, hf_greedy, running_cluster, scheduler_stats
from tests.test_prefix_groups_e2e import make_groups, run_groups
from tests.tiny_models import write_tiny_model

NUM_REQUESTS = 8
DRAFT = ("--speculative-method", "draft", "--draft-num-layers", "2", "--num-speculative-tokens", "3")
NGRAM = ("--speculative-method", "ngram", "--num-speculative-tokens", "3")
SAMPLED = dict(temperature=0.9, top_p=0.95, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return build_tiny_tokenizer(tmp_path_factory.mktemp("tok"), vocab_size=384)


@pytest.fixture(scope="module")
def clusters(tmp_path_factory, tokenizer):
    """(model dir, cluster, client) by (arch, stages, flags), started on first use, stopped with
    the module."""
    started, dirs = {}, {}
    with contextlib.ExitStack() as stack:

        def get(arch: str, stages: int, flags: tuple = ()):
            if arch not in dirs:
                dirs[arch] = write_tiny_model(
                    tmp_path_factory.mktemp(arch), arch=arch, seed=3, tokenizer=tokenizer, num_hidden_layers=4
                )
            key = (arch, stages, flags)
            if key not in started:
                cluster, client = stack.enter_context(
                    running_cluster(dirs[arch], stages, "--max-num-batched-tokens", "64", *flags)
                )
                started[key] = (dirs[arch], cluster, client)
            return started[key]

        yield get


def _workload(vocab: int, seed: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(2, vocab) for _ in range(rng.randint(3, 40))] for _ in range(NUM_REQUESTS)]
    return prompts, [rng.randint(4, 24) for _ in range(NUM_REQUESTS)]  # 40 + 24: past every window


def _sampled(client, prompt):
    """n = 3 children of seed 11, and the single requests of seed 11 + i they must equal."""
    fan = collect(client.generate(prompt, n=3, seed=11, output_kind=generate_pb2.DELTA, **SAMPLED))
    singles = [
        collect(client.generate(prompt, seed=11 + i, output_kind=generate_pb2.DELTA, **SAMPLED))[0] for i in range(3)
    ]
    return fan, singles


CASES = [
    # One architecture per stage count by default: gemma3-3 has a first, a middle and a last stage
    # with its sliding and global layers and its tied head on both ends; gemma3-1 (with a draft of
    # its first 2 layers) is its one-stage twin for the sampled comparison; qwen3_moe-2 has experts
    # (and Qwen3's q/k norms) on both sides of a boundary, with n-gram speculation.
    ("gemma3", 3, ()),
    ("gemma3", 1, DRAFT),
    ("qwen3_moe", 2, NGRAM),
    # Behind the slow marker, each with the default case that covers its path (and every
    # architecture at every split in process: tests/test_model_families.py):
    pytest.param("gemma3", 2, (), marks=pytest.mark.slow),  # gemma3-3's boundaries
    pytest.param("qwen3_moe", 1, (), marks=pytest.mark.slow),  # qwen3_moe-2's layers, gemma3-1's one stage
    pytest.param("qwen3_moe", 3, DRAFT, marks=pytest.mark.slow),  # qwen3_moe-2, gemma3-1's draft
    pytest.param("qwen3", 1, (), marks=pytest.mark.slow),  # qwen3_moe-2's attention (Qwen3's), dense MLPs
    pytest.param("qwen3", 2, NGRAM, marks=pytest.mark.slow),
    pytest.param("qwen3", 3, (), marks=pytest.mark.slow),
    pytest.param("mixtral", 1, DRAFT, marks=pytest.mark.slow),  # qwen3_moe-2's experts (the same kernel path)
    pytest.param("mixtral", 2, (), marks=pytest.mark.slow),
    pytest.param("mixtral", 3, NGRAM, marks=pytest.mark.slow),
]


@pytest.mark.parametrize("arch,stages,flags", CASES, ids=lambda v: "-".join(v) if isinstance(v, tuple) else str(v))
def test_greedy_matches_hf(clusters, tokenizer, arch, stages, flags):
    model_dir, cluster, client = clusters(arch, stages, flags)
    prompts, lengths = _workload(len(tokenizer), seed=stages)
    assert greedy_concurrently(client, prompts, lengths) == hf_greedy(model_dir, prompts, lengths)
    stats = scheduler_stats(cluster)
    assert stats.used_kv_blocks == 0
    if flags:  # drafts were verified (random prompts rarely give n-gram lookup a hit)
        assert stats.spec_decode_draft_tokens > 0


@pytest.mark.parametrize(
    "arch,runs",
    [
        ("gemma3", [(3, ()), (1, DRAFT)]),
        # Behind the slow marker: gemma3's comparison takes the same path (the sampler sees logits).
        pytest.param("qwen3_moe", [(2, NGRAM), (1, ()), (3, DRAFT)], marks=pytest.mark.slow),
        pytest.param("mixtral", [(1, DRAFT), (2, ()), (3, NGRAM)], marks=pytest.mark.slow),
    ],
    ids=["gemma3", "qwen3_moe", "mixtral"],
)
def test_seeded_sampling_and_n3_match_across_stages_and_speculation(clusters, arch, runs):
    prompt = [5, 17, 99, 42, 7, 250, 31, 8, 64, 12, 77, 190]
    results = [_sampled(clusters(arch, stages, flags)[2], prompt) for stages, flags in runs]
    fan, singles = results[0]
    assert sorted(fan) == [0, 1, 2] and len({tuple(t) for t in fan.values()}) == 3
    assert [fan[i] for i in range(3)] == singles  # child i is the request of seed + i
    for other in results[1:]:
        assert other == results[0]


def test_prefix_groups_on_sliding_and_global_layers(clusters):
    """Gemma's global layers read each group's prefix once (cascade), its sliding layers each
    member's window: every member gets the tokens it gets as a request of its own."""
    _, cluster, client = clusters("gemma3", 3)
    groups = make_groups(client.model_info().vocab_size, seed=4, sizes=(4, 3))
    outputs, errors = run_groups(cluster, groups)
    assert not errors and len(outputs) == 7
    for group in groups:
        for member in group.members:
            alone = list(group.prefix_token_ids.ids) + list(member.prompt_token_ids.ids)
            params = {f.name: v for f, v in member.params.ListFields() if f.name != "output_kind"}
            assert (
                outputs[member.request_id]
                == collect(client.generate(alone, output_kind=generate_pb2.DELTA, **params))[0]
            )
    assert scheduler_stats(cluster).used_kv_blocks == 0


def test_json_schema_on_experts_with_speculation(clusters):
    _, _, client = clusters("qwen3_moe", 2, NGRAM)
    schema = {
        "type": "object",
        "properties": {"b": {"enum": ["x", "y"]}},  # a bounded output: the random model ends it
        "required": ["b"],
        "additionalProperties": False,
    }
    final = list(
        client.generate(
            "hello",
            max_tokens=40,
            temperature=1.0,
            seed=3,
            json_schema=json.dumps(schema),
            output_kind=generate_pb2.FINAL_ONLY,
        )
    )[-1]
    assert json.loads(final.outputs[0].text)["b"] in ("x", "y")
    assert final.outputs[0].finish_reason == "stop"

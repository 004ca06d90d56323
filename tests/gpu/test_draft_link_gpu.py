"""The draft link on a GPU (issue 31): with one target stage, the draft worker hands its proposals
straight to the stage (an IPC ring whose slot words the target's stream waits on, or gRPC), and
every request gets the tokens it gets without speculation. The draft worker's proposal replays its
decode graph moved on by a token where the graph draws every row. The draft is the target itself, so a
proposal that reaches its own sequence and positions is accepted.

    python -m pytest tests/gpu/test_draft_link_gpu.py -q
"""

from __future__ import annotations

import pytest
import torch

from strata.v1 import generate_pb2
from tests.cluster import collect, running_cluster, scheduler_stats, tiny_llama_dir

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

LAYERS = 4
PROMPTS = [[5 + i, 17, 42, 99, 3 + i] * (1 + i % 4) for i in range(6)]
FLAGS = ("--device", "cuda:0", "--dtype", "float32")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_llama_dir(tmp_path_factory, seed=17, layers=LAYERS)


def _run(client):
    out = []
    for i, prompt in enumerate(PROMPTS):
        # Greedy, seeded with top-p (drawn outside the draft's graphs: a decode plan a step) and
        # seeded alone (the draft's graph replayed moved on: ModelRunner.decode_again).
        kw = [dict(temperature=0.0), dict(temperature=0.8, top_p=0.9, seed=i), dict(temperature=0.7, seed=i)][i % 3]
        stream = client.generate(
            prompt, max_tokens=40, ignore_eos=True, output_kind=generate_pb2.DELTA, timeout=300, **kw
        )
        out.append(collect(stream)[0])
    return out


@pytest.fixture(scope="module")
def plain(model_dir):
    with running_cluster(model_dir, 1, *FLAGS) as (_, client):
        return _run(client)


@pytest.mark.parametrize(
    "extra",
    [("--stage-transport", "ipc"), ("--stage-transport", "grpc"), ("--draft-proposals", "scheduler")],
    ids=["ipc-link", "grpc-link", "scheduler"],
)
def test_linked_drafts_give_the_plain_tokens_and_are_accepted(model_dir, plain, extra):
    flags = ("--speculative-method", "draft", "--draft-num-layers", str(LAYERS), "--num-speculative-tokens", "4")
    flags += ("--no-adaptive-speculation",)  # every step verifies: the cost model would turn a draft this dear off
    with running_cluster(model_dir, 1, *FLAGS, *flags, *extra) as (cluster, client):
        got = _run(client)
        stats = scheduler_stats(cluster)
    assert got == plain
    linked = "scheduler" not in extra
    assert (stats.spec_decode_linked_proposals > 0) == linked and stats.spec_decode_failed_proposals == 0
    assert stats.spec_decode_draft_tokens > 0
    # (float32; a verify step's sums differ from single decode steps', so a rare sampled draw may differ)
    assert stats.spec_decode_accepted_tokens >= 0.9 * stats.spec_decode_draft_tokens

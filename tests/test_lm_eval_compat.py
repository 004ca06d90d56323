"""lm-evaluation-harness against Strata's OpenAI front (issue 52): a multiple-choice task scored by
lm-eval's `local-completions` model on `strata serve` must give what lm-eval's own `hf` backend
gives on the same weights: the same accuracy, and each choice's loglikelihood within 1e-3.

`local-completions` scores a choice by sending context + continuation with `echo: true,
logprobs: 1, max_tokens: 1, temperature: 0` and summing `choices[i].logprobs.token_logprobs`
over the continuation's tokens (it counts the context's tokens with the tokenizer it is given).
With `tokenized_requests` on it sends the prompt as token ids, `[[id, ...], ...]` (one list per
prompt, even at batch size 1); off, as the decoded text (one string, or a list of strings when it
batches). Both, and batches of several prompts, are checked.

The task (tests/data/lm_eval_mc/) is ours: 34 questions with 2-4 choices each, 108 requests.
Both sides run float32 on CPU, on SmolLM2-135M-Instruct, built by `strata build-model
smollm2-135m`; the prefix cache stays on. Slow: the reference and the cluster's start take about
15 s on 2 cores, then each case sends 108 requests (Strata answers that many plain ones in about
11 s). Needs `pip install -e '.[eval]'` (lm-eval 0.4.13)."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from strata.default_model import ensure_default_model
from tests.cluster import running_cluster

# lm-eval is imported where it runs, not at collection (it is heavy, and CI goes without it).
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("lm_eval") is None, reason="needs lm-eval: pip install -e '.[eval]'"),
]

TASK_DIR = Path(__file__).parent / "data" / "lm_eval_mc"
TASK = "strata_mc"
TOLERANCE = 1e-3  # per choice, on the summed loglikelihood of its tokens


@pytest.fixture(autouse=True, scope="module")
def offline():
    """Nothing may come from the model hub: both backends read the local model directory."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_default_model()


def evaluate(model: str, model_args: dict, batch_size: int = 1) -> dict:
    """lm-eval's Python API on the local task, with every request's response logged."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[TASK],
        task_manager=TaskManager(include_path=str(TASK_DIR), include_defaults=False),
        batch_size=batch_size,
        log_samples=True,
        bootstrap_iters=0,
    )
    assert results is not None
    return results


def per_choice(results: dict) -> dict[int, tuple[list[tuple[str, str]], list[tuple[float, bool]]]]:
    """doc_id -> ([(context, continuation)] and [(loglikelihood, is_greedy)], one per choice)."""
    out = {}
    for sample in results["samples"][TASK]:
        args = [tuple(a) for a in sample["arguments"]]  # each request's (context, continuation)
        scores = [(float(ll), bool(greedy)) for ll, greedy in sample["filtered_resps"]]
        assert len(args) == len(scores) == len(sample["doc"]["choices"])
        out[sample["doc_id"]] = (args, scores)
    return out


def accuracy(results: dict) -> tuple[float, float]:
    metrics = results["results"][TASK]
    return metrics["acc,none"], metrics["acc_norm,none"]


@pytest.fixture(scope="module")
def reference(model_dir):
    """lm-eval's own `hf` backend: transformers on the same weights, float32, on CPU."""
    results = evaluate("hf", {"pretrained": str(model_dir), "dtype": "float32", "device": "cpu"})
    choices = per_choice(results)
    assert len(choices) == len(TASK_DIR.joinpath("questions.jsonl").read_text().splitlines()) == 34
    assert sum(len(args) for args, _ in choices.values()) == 108
    # Every loglikelihood is a real number below zero: the comparison below compares something.
    assert all(math.isfinite(ll) and ll < 0 for _, scores in choices.values() for ll, _ in scores)
    assert any(greedy for _, scores in choices.values() for _, greedy in scores)  # both values occur
    return results


@pytest.fixture(scope="module")
def cluster(model_dir):
    # float32 to match the reference (also the CPU default); the prefix cache stays on, as served:
    # a question's choices share its context, so most requests find their context cached.
    with running_cluster(model_dir, 1, "--dtype", "float32") as (c, _client):
        yield c


@pytest.mark.parametrize(
    "tokenized, batch_size",
    [
        pytest.param(True, 1, id="token-ids"),  # prompt: [[ids]]
        pytest.param(False, 1, id="text"),  # prompt: "text"
        pytest.param(True, 4, id="token-ids-batched"),  # prompt: [[ids], [ids], [ids], [ids]]
    ],
)
def test_local_completions_scores_as_hf_does(reference, cluster, model_dir, tokenized, batch_size):
    served = evaluate(
        "local-completions",
        {
            "model": model_dir.name,  # the name Strata serves it under
            "base_url": cluster.http_address + "/v1/completions",
            # lm-eval counts the context's tokens itself: the served model's own tokenizer, read
            # from the local directory (its "auto" backend would ask the server for
            # /tokenizer_info, which Strata does not serve, then fall back to the hub).
            "tokenizer": str(model_dir),
            "tokenizer_backend": "huggingface",
            "tokenized_requests": tokenized,
            "max_retries": 1,  # a refused request fails the run at once
        },
        batch_size=batch_size,
    )
    want, got = per_choice(reference), per_choice(served)
    assert got.keys() == want.keys()
    worst = 0.0
    for doc_id, (args, scores) in want.items():
        got_args, got_scores = got[doc_id]
        assert got_args == args  # the same (context, continuation) pairs were scored
        for choice, ((ll, greedy), (got_ll, got_greedy)) in enumerate(zip(scores, got_scores)):
            assert abs(got_ll - ll) <= TOLERANCE, f"doc {doc_id} choice {choice}: {got_ll} != {ll}"
            # Greedy from the served top_logprobs (the chosen token's logprob equals its position's
            # top one) against the reference's argmax. In this task the chosen token's logprob is
            # at least 0.06 away from the best other token's at every continuation position (HF,
            # float32), so float noise cannot flip it; 2 of the 108 choices are greedy.
            assert got_greedy == greedy, f"doc {doc_id} choice {choice}: is_greedy {got_greedy} != {greedy}"
            worst = max(worst, abs(got_ll - ll))
    assert accuracy(served) == accuracy(reference)
    print(f"accuracy {accuracy(served)}, largest loglikelihood difference {worst:.2e}")

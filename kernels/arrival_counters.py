"""Arrival counters for kernels whose last program to finish a unit of work merges the others'.

A split kernel (decode attention's KV splits, the sampler's vocabulary splits, decode_moe's k
slots) stores its partials, then bumps its unit's counter with an acq_rel atomic; the program
that sees the count reach the number of parts reads every partial back, merges them and resets
the counter to 0. That saves the separate merge launch, and with no spinning no order of
programs can deadlock. (decode_moe's one launch also keeps its ticket counter here, and its only
spin waits for items already handed to running programs.)

The counters are zeroed once and kept across calls (every launch leaves them at 0), one buffer
per device and owner kernel: launches of one owner run in stream order, never two at once.
They are made outside any graph capture in practice, as the runner's warm-up calls first.
"""

from __future__ import annotations

import torch
import triton

_COUNTERS: dict[tuple[str, str, int | None], torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers: CUDA graphs may still point at them


def arrival_counters(device: torch.device, count: int, owner: str) -> torch.Tensor:
    """At least `count` zeroed int32 counters on `device`, kept for kernel `owner`."""
    key = (owner, device.type, device.index)
    counters = _COUNTERS.get(key)
    if counters is None or counters.numel() < count:
        if counters is not None:
            _RETIRED.append(counters)
        counters = torch.zeros(max(4096, triton.next_power_of_2(count)), dtype=torch.int32, device=device)
        _COUNTERS[key] = counters
    return counters

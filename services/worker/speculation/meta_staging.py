"""The speculation meta rows a step stages on the device before its forward: a static buffer
(MetaStaging) that the eager commit, the decode graphs and the verification graphs read, and the
layout of a verification graph's staged block (fill_staged_rows): row 0 the gates, then a meta
row per sequence (kernels/spec_decode.py's columns), then padding rows.
"""

from __future__ import annotations

import numpy as np
import torch

from strata.services.worker.device.host_to_device import wait_for


class MetaStaging:
    """A static device buffer of meta rows and two pinned host twins (the host fills one while
    the other's copy may still wait in the stream), as the CUDA graphs stage their inputs: for
    eager steps, decode graphs and commits after the sampler. Its layout is a verification
    graph's staged block (fill_staged_rows): row 0 the gates (GATE_COMMIT, GATE_PROPOSE, which
    only a graph's own commit reads), then the meta rows; a graph starts from its padding."""

    def __init__(self, rows: int, pad_row: np.ndarray, device: torch.device):
        self.device = device
        self.buffer = torch.as_tensor(np.tile(pad_row, (rows + 1, 1)), device=device)
        self.buffer[0] = 0  # every gate shut
        self.gates = self.buffer[0]
        self.meta_rows = self.buffer[1:]
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.host = [self.buffer.cpu().pin_memory() for _ in range(2)]
            self.copied = [torch.cuda.Event(), torch.cuda.Event()]
            for event in self.copied:
                event.record()
        self.step = 0

    def stage(self, meta: np.ndarray, padded_rows: int, pad_row: np.ndarray, gates: tuple[int, int]) -> torch.Tensor:
        total = max(padded_rows, meta.shape[0])
        if not self.cuda:
            out = self.buffer.numpy()
        else:
            i = self.step % 2
            self.step += 1
            wait_for(self.copied[i])
            out = self.host[i].numpy()
        fill_staged_rows(out, meta, total, pad_row, gates)
        if self.cuda:
            self.buffer[: total + 1].copy_(self.host[i][: total + 1], non_blocking=True)
            self.copied[i].record()
        return self.meta_rows[:total]

    def reset(self, pad_row: np.ndarray) -> None:
        self.meta_rows.copy_(torch.as_tensor(pad_row, device=self.device).expand_as(self.meta_rows))
        self.gates.zero_()


GATE_COMMIT, GATE_PROPOSE = 0, 1


def fill_staged_rows(out: np.ndarray, meta: np.ndarray, total: int, pad_row: np.ndarray, gates) -> None:
    """A staging block's host rows: the gates in row 0, the meta rows, padding rows up to total."""
    n = meta.shape[0]
    out[0, : len(gates)] = gates
    out[1 : n + 1] = meta
    out[n + 1 : total + 1] = pad_row

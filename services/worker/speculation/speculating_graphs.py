"""The decode graphs of a worker that speculates on its device (speculation.device_speculation):
decode graphs that record their draws in the sequences' device history, and verification graphs
that move a plan's positions back by the drafts rejected since it was sent, commit their own
draws and propose the next drafts inside the graph, and advance to the next verification round
on the device.
"""

from __future__ import annotations

import torch

from strata.kernels.spec_decode import advance_round
from strata.services.worker.graphs.cuda_graphs import capturing
from strata.services.worker.speculation.device_speculation import DeviceSpeculation


def recording_decode_graphs(spec: DeviceSpeculation):
    """DecodeGraphs of a speculating worker: a graph that draws also records its tokens in
    history (DeviceSpeculation.record), so that a plain step adds no host work to a plain
    cluster's. A step whose draw runs outside the graph records after it (after_draw)."""
    from strata.services.worker.graphs.cuda_graphs import DecodeGraphs

    class RecordingDecodeGraphs(DecodeGraphs):
        def _forward(self, bs: int):
            outs = super()._forward(bs)
            if self.samples:
                rows = self.rows
                spec.record(rows["state_rows"][:bs], rows["sample_positions"][:bs], outs[1])
            return outs

    return RecordingDecodeGraphs


def shifting_verify_graphs(spec: DeviceSpeculation):
    """DecodeGraphs for verification steps whose graphs first move each sequence's positions,
    sample positions, slots and length back by its shift (kernels/spec_decode.py), reading the
    meta rows staged for the step: a plan sent before an earlier verification came back runs
    from the graph's own copy of its inputs, moved on the device."""
    from strata.kernels.spec_decode import shift_positions_in_graph
    from strata.services.worker.device import cuda_driver
    from strata.services.worker.graphs.cuda_graphs import DecodeGraphs

    class ShiftingVerifyGraphs(DecodeGraphs):
        commits = True  # the graph's draw, when it is the step's result, is committed in it

        def __init__(self, *args, **kwargs):
            # The step's gates and meta rows, staged with its inputs (DeviceSpeculation.stage).
            super().__init__(*args, extra_shape=(kwargs["max_batch"] + 1, spec.columns), **kwargs)

        def _fill_padding(self) -> None:
            super()._fill_padding()
            self.extra.copy_(spec.staging.buffer[: self.extra.shape[0]])  # gates shut, padding rows

        def capture(self) -> None:
            super().capture()
            self._capture_advance()

        def _capture_advance(self) -> None:
            """Per size, a small graph that moves the static inputs on to the next verification
            round (advance_round), on its own memory pool: the verification graphs' outputs
            sit in theirs."""
            q, rows = self.query_len, self.rows
            self.advance_graphs, self.advance_executables = {}, {}
            for bs in self.sizes:
                t = bs * q
                token_seq = torch.arange(t, device=self.device) // q
                first = torch.arange(bs, device=self.device) * q

                def advance(bs=bs, t=t, token_seq=token_seq, first=first):
                    moves = advance_round(
                        self.extra[1 : bs + 1],
                        spec.hist_len,
                        rows["positions"][:t],
                        rows["slot_mapping"][:t],
                        rows["seq_lens"][:bs],
                        rows["input_ids"][:t] if self.first_stage else None,
                        self.block_tables[:bs],
                        token_seq,
                        first,
                        spec.block_size,
                        spec.scratch_row,
                    )
                    rows["sample_positions"][:t] += moves

                advance()  # on padding rows: every one sits out, nothing moves
                torch.cuda.synchronize(self.device)
                graph = torch.cuda.CUDAGraph()
                with capturing(graph):
                    advance()
                self.advance_graphs[bs] = (graph, token_seq, first)  # (the indices must outlive it)
                executable = cuda_driver.graph_exec(graph)
                if executable is not None:
                    self.advance_executables[bs] = executable
            torch.cuda.synchronize(self.device)
            self._fill_padding()

        def advance(self, bs: int) -> None:
            """The inputs moved on to the next verification round (the captured advance)."""
            if bs in self.advance_executables:
                cuda_driver.launch(self.advance_executables[bs], cuda_driver.current_stream(self.device))
            else:
                self.advance_graphs[bs][0].replay()

        def _forward(self, bs: int):
            t, rows = bs * self.query_len, self.rows
            shift_positions_in_graph(
                self.extra[1:],
                spec.rejected,
                rows["positions"][:t],
                rows["sample_positions"][:t],
                rows["slot_mapping"][:t],
                rows["seq_lens"][:bs],
                self.block_tables[:bs],
                self.query_len,
                spec.block_size,
            )
            outs = super()._forward(bs)
            if self.samples:
                spec.commit_in_graph(outs[1], bs, self.extra)
            return outs

    return ShiftingVerifyGraphs

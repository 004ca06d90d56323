"""A launched step's result on its way back: sampled tokens copied to the host behind the step,
the StepResult proto they become, and the step's GPU time from CUDA events.

The step thread launches a step and moves on to the next plan; a finisher thread waits here for
the copy (the step's one host-device synchronisation) and encodes the proto, so the wait never
delays the next launch.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from strata.services.worker.device import cuda_driver
from strata.services.worker.device.device_to_host import HostCopies
from strata.services.worker.sampling.prompt_logprobs import add_to_result
from strata.services.worker.speculation.verification import Verification, accepted_rows, emitted_rows, round_tokens
from strata.v1 import engine_pb2


class GpuTimeline:
    """The GPU's busy and idle time per step, from CUDA events (the host's clocks cannot see it).

    A step's start event is recorded just before its first kernel is queued, its end event after
    its last copy; the GPU reaches the start event when the previous step's work is done or, if
    the host was late, when the host queued it. So end(k) -> start(k+1) is the GPU idle between
    steps, start(k) -> end(k) the step's GPU time. Steps finish in order (one finisher thread).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._last_end: cuda_driver.TimingEvent | None = None

    def mark(self) -> cuda_driver.TimingEvent:
        """On the step thread: an event recorded on its current stream now (through the driver:
        torch's record gave the GIL away, cuda_driver.py)."""
        return cuda_driver.timing_event(self.device)

    def finished(self, start, end) -> tuple[float, float]:
        """(busy seconds, idle seconds before the step); `end` must have completed."""
        busy = start.elapsed_time(end) / 1e3
        idle = max(self._last_end.elapsed_time(start) / 1e3, 0.0) if self._last_end is not None else 0.0
        self._last_end = end
        return busy, idle


class PendingResult:
    """A step's sampled tokens on their way to the host. The copy is queued behind the step on
    the GPU; finish() waits for it, so the step thread can already launch the next plan.

    tensors: [token_ids], plus [logprobs, top_ids, top_logprobs] when some row asked for
    logprobs (the Sampler's outputs), one per sample row; none when nothing was sampled.
    wanted_logprobs: each row's own top count (the tensors hold the largest). verify: the rows
    of sequences that verify drafts (step_inputs.Verification)."""

    def __init__(
        self,
        step_id: int,
        start: float,
        seq_ids: list[int],
        wanted_logprobs: np.ndarray,
        tensors: list[torch.Tensor],
        timeline: GpuTimeline | None = None,
        gpu_start: cuda_driver.TimingEvent | None = None,
        verify: Verification | None = None,
        take: np.ndarray | None = None,
        speculation: tuple[torch.Tensor, np.ndarray] | None = None,
        rounds: np.ndarray | None = None,
        prompt: tuple[list[torch.Tensor], np.ndarray] | None = None,
    ):
        self.step_id, self.start, self.seq_ids, self.wanted = step_id, start, seq_ids, wanted_logprobs
        self.verify = verify
        self.take = take  # the sample rows among the tokens drawn (a padded verification graph)
        self.copies = HostCopies()
        self.host = [self.copies.take(x) for x in tensors]
        # Speculation on the device (speculation/device_speculation.py): its packed per-sequence outcome (tokens
        # emitted, drafts proposed, the drafts) and the sampling sequences' rows in it.
        self.speculation = None
        if speculation is not None:
            self.speculation = (self.copies.take(speculation[0]), speculation[1])
        # Several verification rounds (StepPlan.verify_rounds): each sampling sequence's rounds;
        # the token tensor and the packed outcome then hold a row per round.
        self.rounds = rounds
        # Prompt logprobs (sampling/prompt_logprobs.py): their tensors and each row's k.
        self.prompt = None
        if prompt is not None:
            self.prompt = ([x.to("cpu", non_blocking=True) for x in prompt[0]], prompt[1])
        self.timeline, self.gpu_start = timeline, gpu_start
        # The copies' completion, which finish() waits for (on a GPU).
        self.event = timeline.mark() if timeline is not None else None
        self.launch_seconds = time.perf_counter() - start

    def finish(self) -> engine_pb2.StepResult:
        result = engine_pb2.StepResult(step_id=self.step_id, launch_seconds=self.launch_seconds)
        if self.event is not None:
            self.event.synchronize()
            if self.gpu_start is not None:
                result.gpu_seconds, result.gpu_idle_seconds = self.timeline.finished(self.gpu_start, self.event)
        try:
            self._fill(result)
        finally:
            self.copies.give_back()
        result.execute_seconds = time.perf_counter() - self.start
        return result

    def _fill(self, result: engine_pb2.StepResult) -> None:
        """The step's tokens, logprobs, proposals and prompt logprobs, from the host copies."""
        packed = None
        if self.speculation is not None:
            packed = np.asarray(self.speculation[0])[..., self.speculation[1], :]
        if self.seq_ids:
            result.seq_ids.extend(self.seq_ids)
            emitted = None
            if self.rounds is not None:  # (its rows ask for no logprobs)
                packed = self._add_rounds(result, packed)
            elif self.verify is None:  # one token per sequence (most steps)
                token_ids = self.host[0].tolist()
                result.num_tokens.extend([1] * len(token_ids))
                result.token_ids.extend(token_ids)
            else:
                tokens = np.asarray(self.host[0])
                if self.take is not None:
                    tokens = tokens[self.take]
                if packed is not None:  # verified on the device (its drafts may be there only)
                    num_tokens, emitted = packed[:, 0], emitted_rows(packed[:, 0], self.verify)
                else:
                    num_tokens, emitted = accepted_rows(tokens, self.verify)
                result.num_tokens.extend(num_tokens.tolist())
                result.token_ids.extend(tokens[emitted].tolist())
            if len(self.host) > 1:
                self._add_logprobs(result, emitted)
            if packed is not None and packed[:, 1].any():
                counts = packed[:, 1]
                result.num_proposed.extend(counts.tolist())
                result.proposed_token_ids.extend(
                    packed[:, 2:][np.arange(packed.shape[1] - 2) < counts[:, None]].tolist()
                )
        if self.prompt is not None:
            add_to_result(result, *self.prompt)

    def _add_rounds(self, result: engine_pb2.StepResult, packed: np.ndarray) -> np.ndarray:
        """Every round's emitted tokens, sequence by sequence and round by round; returns each
        sequence's last round's packed row (its proposals for the next step)."""
        tokens = np.asarray(self.host[0])  # [rounds, rows]
        if self.take is not None:
            tokens = tokens[:, self.take]
        rounds = self.rounds
        ran = np.arange(packed.shape[0])[:, None] < rounds[None, :]  # [rounds, n]
        counts = np.where(ran, packed[:, :, 0], 0)
        num_tokens, emitted = round_tokens(tokens, counts, self.verify)
        result.num_tokens.extend(num_tokens.tolist())
        result.token_ids.extend(emitted.tolist())
        result.round_num_tokens.extend(counts.T.ravel().tolist())
        result.round_num_proposed.extend(np.where(ran, packed[:, :, 1], 0).T.ravel().tolist())
        return packed[rounds - 1, np.arange(len(rounds))]

    def _add_logprobs(self, result: engine_pb2.StepResult, emitted: np.ndarray | None) -> None:
        """Logprobs of the emitted rows (all rows without verification); only when asked."""
        _, logprobs, top_ids, top_lps = (np.asarray(x) for x in self.host)
        wanted = self.wanted
        if emitted is not None:
            logprobs, top_ids, top_lps, wanted = logprobs[emitted], top_ids[emitted], top_lps[emitted], wanted[emitted]
        result.logprobs.extend(logprobs.tolist())
        for i in range(len(wanted)):  # per emitted token, only when logprobs were asked
            k = max(int(wanted[i]), 0)
            result.num_top.append(k)
            result.top_token_ids.extend(top_ids[i, :k].tolist())
            result.top_logprobs.extend(top_lps[i, :k].tolist())

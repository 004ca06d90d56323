"""ModelRunner: runs one step plan on this stage.

A step: apply the plan's deltas to the sequence table (step/sequence_table.py), build its inputs
(step/step_inputs.py), run the shard by replaying a decode or verification graph
(graphs/cuda_graphs.py; what the replay draws and commits: step/graph_step.py), on the piecewise
graphs of a mixed step (graphs/piecewise_graphs.py), or eagerly, and on the last stage sample
(sampling/) and return a PendingResult (step/step_results.py) whose tokens reach the host while
the next plan is launched. With speculation on this device, speculation/device_speculation.py
moves, verifies and proposes around the draw.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from strata.kernels.gumbel_sampling import HAVE_TRITON
from strata.services.worker.device.host_to_device import upload
from strata.services.worker.diagnostics.gpu_clock import GpuClock
from strata.services.worker.graphs.warm_up import warm_up, warn_on_late_compiles
from strata.services.worker.model.attention import AttentionMetadata, allocate_kv_cache
from strata.services.worker.sampling.prompt_logprobs import PromptRows, asked_rows, prompt_logprobs
from strata.services.worker.sampling.sampler import Sampler, SamplingTensors
from strata.services.worker.sampling.sampling_controls import SamplingControls
from strata.services.worker.sampling.sharded import ShardedSampler
from strata.services.worker.speculation.device_speculation import DeviceSpeculation
from strata.services.worker.speculation.speculating_graphs import recording_decode_graphs, shifting_verify_graphs
from strata.services.worker.step.cascade_inputs import shared_kv_runs
from strata.services.worker.step.graph_step import DecodeReplay, run_on_graph
from strata.services.worker.step.sequence_table import PlanError, SequenceTable
from strata.services.worker.step.step_inputs import HostInputs, StepInputBuilder
from strata.services.worker.step.step_results import GpuTimeline, PendingResult
from strata.services.worker.tensor_parallel.group import TensorParallelGroup, single_rank
from strata.services.worker.tensor_parallel.vocab import VocabShard
from strata.v1 import engine_pb2


def use_device(device: torch.device) -> None:
    """Makes `device` the calling thread's current CUDA device. Torch's own ops follow their
    tensors' device, but Triton launches, CUDA graph capture and current_stream() use the
    thread's current device: a stage on cuda:1 (a GPU per stage) must set it in every thread
    that launches work, or its kernels go to cuda:0's context ("Pointer argument cannot be
    accessed from Triton")."""
    if device.type == "cuda":  # (main.pick_device always gives the index set_device needs)
        torch.cuda.set_device(device)


class ModelRunner:
    """This stage's shard, KV cache, sequence table and (last stage) sampler, driven by plans."""

    def __init__(
        self,
        shard,
        model_config,
        *,
        stage_index: int,
        num_stages: int,
        block_size: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        max_num_seqs: int = 1024,
        cuda_graph_max_batch: int = 0,
        num_speculative_tokens: int = 0,
        speculative_max_batch: int = 0,
        piecewise_max_tokens: int = 0,
        tokenizer_dir: str | None = None,
        ngram_on_device: tuple[int, int] | None = None,
        gpu_clock_dir: str | None = None,
        tp: TensorParallelGroup | None = None,
    ):
        self.shard = shard
        # Tensor parallelism: this rank's group and its slice of the vocabulary (the logits'
        # columns); the last stage draws exactly over the slices (sampling/sharded.py).
        self.tp = tp or single_rank(device)
        self.vocab = VocabShard(model_config.vocab_size, self.tp.rank, self.tp.size)
        if getattr(shard, "vocab", self.vocab) != self.vocab:
            raise ValueError("the shard holds another vocabulary slice than this rank's (load_shard's tp)")
        self.config = model_config
        self.stage_index = stage_index
        self.is_first = stage_index == 0
        self.is_last = stage_index == num_stages - 1
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.dtype = dtype
        self.kv_caches: list[torch.Tensor] = []
        self.table = SequenceTable(
            max_num_seqs, (max_model_len + block_size - 1) // block_size, vocab_size=model_config.vocab_size
        )
        self.inputs = StepInputBuilder(
            self.table,
            block_size=block_size,
            max_model_len=max_model_len,
            first_stage=self.is_first,
            last_stage=self.is_last,
            device=device,
            vocab_size=model_config.vocab_size,
        )
        self.sampler = None
        if self.is_last:
            self.sampler = ShardedSampler(self.tp, self.vocab) if self.tp.active else Sampler()
        self.graphs = None  # DecodeGraphs once captured (CUDA only)
        self.cascade_graphs = None  # the same for decode batches with shared prefixes
        self.cuda_graph_max_batch = cuda_graph_max_batch if device.type == "cuda" else 0
        # Steps no decode graph serves, up to this many tokens, replay piecewise graphs.
        self.piecewise = None
        self.piecewise_max_tokens = piecewise_max_tokens if device.type == "cuda" else 0
        # Verification graphs, by query length (2 .. k + 1), for batches up to the speculative limit.
        self.verify_graphs: dict[int, object] = {}
        self.verify_query_lens = range(2, num_speculative_tokens + 2) if self.cuda_graph_max_batch else range(0)
        self.verify_max_batch = min(speculative_max_batch, self.cuda_graph_max_batch)
        # The last token sampled per state row (decode lookahead), plus a scratch row that the
        # decode graphs' padding rows write to (and, with prompt lookup on this device, each
        # row's drafts after them: speculation/device_speculation.py).
        self.scratch_row = max_num_seqs
        spec_k = num_speculative_tokens if ngram_on_device is not None and self.is_last else 0
        size = DeviceSpeculation.last_sampled_size(max_num_seqs, spec_k) if spec_k else max_num_seqs + 1
        self.last_sampled = torch.zeros(size, dtype=torch.long, device=device)
        # Speculation on this device (ngram_on_device: (ngram_min, ngram_max) of prompt lookup).
        self.spec = None
        if spec_k:
            self.spec = DeviceSpeculation(
                max_seqs=max_num_seqs,
                max_model_len=max_model_len,
                max_k=spec_k,
                ngram_min=ngram_on_device[0],
                ngram_max=ngram_on_device[1],
                block_size=block_size,
                last_sampled=self.last_sampled,
                device=device,
            )
            self.table.speculation = self.spec
            if self.is_first:
                self.inputs.speculation = self.spec
        # Penalties, biases and grammars of the sequences that use them (last stage).
        self.controls = None
        if self.is_last:
            self.controls = SamplingControls(
                max_num_seqs,
                model_config.vocab_size,
                max_model_len,
                device,
                self.last_sampled,
                tokenizer_dir,
                getattr(model_config, "eos_token_id", None),
            )
            # The controlled draw reads whole rows: tensor-parallel ranks gather controlled rows.
            self.controls.fused_draw = not self.tp.active
            self.table.controls = self.controls
        self.timeline = GpuTimeline(device) if device.type == "cuda" else None
        self.clock = GpuClock.for_stage(gpu_clock_dir, self.stage_index, device)  # cross-stage GPU stamps (diagnostic)
        # Pipelined decode over P > 1 stages (token_handoff.py): stage 0's TokenIntake, which
        # fills last_sampled from the last stage's tokens, or the last stage's TokenOutlet; on a
        # one-stage target with a draft worker, the DraftIntake of its proposals.
        self.handoff = None
        self.gpu_start = None  # the latest step's start event (CUDA)
        # The latest step, if it was a decode whose graph drew every row, which decode_again
        # replays moved on by a token.
        self.decode_graph_step: DecodeReplay | None = None

    # ------------------------------------------------------------ cache

    def init_cache(self, num_blocks: int) -> None:
        self.decode_graph_step = None
        self.kv_caches = []  # free the old cache (and graphs over it) before allocating the new one
        self.graphs = self.cascade_graphs = self.piecewise = None
        self.verify_graphs = {}
        self.kv_caches = allocate_kv_cache(
            self.shard.num_layers,
            num_blocks,
            self.block_size,
            self.config.num_key_value_heads,
            self.config.head_dim,
            self.dtype,
            self.device,
        )
        self.table.reset(num_blocks)
        if self.cuda_graph_max_batch:
            self._capture_graphs()
        if self.piecewise_max_tokens:
            from strata.services.worker.graphs.piecewise_graphs import PiecewiseGraphs

            self.piecewise = PiecewiseGraphs(
                self.shard,
                self.kv_caches,
                max_tokens=self.piecewise_max_tokens,
                last_sampled=self.last_sampled,
                scratch_row=self.scratch_row,
                device=self.device,
                dtype=self.dtype,
            )
            self.piecewise.capture()
        if self.device.type == "cuda":
            warm_up(
                self.shard,
                self.kv_caches,
                self.sampler,
                hidden_size=self.config.hidden_size,
                dtype=self.dtype,
                device=self.device,
                vocab_width=self.vocab.local,
            )
            if self.spec is not None:
                self.spec.warm_up()
            warn_on_late_compiles()

    def _capture_graphs(self) -> None:
        from strata.services.worker.graphs.cuda_graphs import DecodeGraphs

        def capture(max_batch: int, query_len: int, cascade: bool = False) -> DecodeGraphs:
            # Verification graphs move a plan's positions on the device first (speculation's
            # lookahead); decode graphs record their draws in the device history.
            cls = DecodeGraphs
            if self.spec is not None:
                cls = shifting_verify_graphs(self.spec) if query_len > 1 else recording_decode_graphs(self.spec)
            graphs = cls(
                self.shard,
                self.kv_caches,
                max_batch=max_batch,
                last_sampled=self.last_sampled,
                scratch_row=self.scratch_row,
                device=self.device,
                dtype=self.dtype,
                hidden_size=self.config.hidden_size,
                max_blocks_per_seq=self.table.max_blocks,
                max_model_len=self.max_model_len,
                first_stage=self.is_first,
                last_stage=self.is_last,
                samples=self.is_last and HAVE_TRITON,
                query_len=query_len,
                cascade=cascade,
                draw=self.sampler.draw_unfiltered if self.tp.active and self.is_last else None,
                compute_logits=self.compute_logits,
            )
            graphs.capture()
            return graphs

        self.graphs = capture(self.cuda_graph_max_batch, 1)
        if self.cuda_graph_max_batch >= 2:
            self.cascade_graphs = capture(self.cuda_graph_max_batch, 1, cascade=True)
        if self.verify_max_batch:
            self.verify_graphs = {q: capture(self.verify_max_batch, q) for q in self.verify_query_lens}

    def _copy_blocks(self, src, dst) -> None:
        """Copy-on-write of shared partial blocks, in every layer's cache."""
        blocks = upload({"src": np.asarray(src, dtype=np.int64), "dst": np.asarray(dst, dtype=np.int64)}, self.device)
        for cache in self.kv_caches:
            cache[:, blocks["dst"]] = cache[:, blocks["src"]]

    # ------------------------------------------------------------ steps

    def apply_plan(self, plan: engine_pb2.StepPlan) -> np.ndarray:
        """Applies the plan's deltas (sequence table, block copies); returns the rows of its sequences."""
        rows = self.table.apply(plan)
        if plan.copy_src_blocks:
            self._copy_blocks(plan.copy_src_blocks, plan.copy_dst_blocks)
        return rows

    @torch.inference_mode()
    def execute(
        self,
        plan: engine_pb2.StepPlan,
        hidden: torch.Tensor | None = None,
        residual: torch.Tensor | None = None,
        take_inputs=None,
    ):
        """Launches one step. Returns (hidden, residual) on a middle stage, a PendingResult on the last.
        take_inputs: how a later stage takes (hidden, residual) from its link (ipc). What a step
        waits for from the other stages (those activations; stage 0's tokens for its
        placeholders) is taken last, once its host inputs are built and staged (arrive), so the
        staging is off the pipeline's critical path: with one micro-batch, the GPU waited for
        it after every hop."""
        start = time.perf_counter()
        self.decode_graph_step = None
        if plan.linked_drafts and not getattr(self.handoff, "takes_drafts", False):
            raise PlanError("linked_drafts needs this stage's end of the draft link (OpenTokenLink, drafts)")
        if self.handoff is not None:
            self.handoff.plan_started(plan)
        rows = self.apply_plan(plan)
        # A step that verifies drafts on a verification graph attends without shared-KV runs.
        verifies_on_graph = bool(self.verify_graphs) and any(plan.num_draft_tokens)
        h = built = self.inputs.build(plan, rows, shared_kv=not verifies_on_graph)
        spec = None
        if self.spec is not None:  # known tokens into the device history, the step's speculation rows
            tokens = h.input_ids if h.input_ids is not None else np.asarray(plan.input_token_ids, dtype=np.int64)
            spec = self.spec.begin_step(plan, h, tokens)
        if self.handoff is None and h.has_placeholders and not self.is_last:
            raise PlanError("a decode lookahead on stage 0 of several needs the token link (OpenTokenLink)")
        rounds = spec.rounds if spec is not None else 1
        if rounds > 1:
            self._check_rounds(h)
        # Prompt logprobs need the hidden states of prompt positions: such a step runs eagerly.
        prompt = self._asked_prompt_rows(plan, h, rows) if self.is_last and plan.prompt_logprob_counts else None

        def arrive(into=None, staged_rows=None):
            """Waits for what the step needs from the other stages, then marks the step's start
            on the stage's timeline (stage_stats.py); returns the activations taken, if any,
            copied into `into` (a graph's (hidden, residual) inputs) when given. staged_rows: a
            graph's token rows on the device (the token hand-off may gather through them)."""
            if self.clock:
                self.clock.stamp(plan.step_id, "queued")
            if take_inputs is not None:
                taken = take_inputs(into)
            elif into is not None and hidden is not None:
                taken = tuple(dst[: len(src)].copy_(src) for dst, src in zip(into, (hidden, residual)))
            else:
                taken = (hidden, residual)
            if self.handoff is not None:  # stage 0 waits here for the tokens its placeholders need
                self.handoff.before_step(plan.step_id, h, staged_rows)
            if self.clock:
                self.clock.stamp(plan.step_id, "start")
                self.clock.note_need(plan.step_id, getattr(self.handoff, "need", 0))
            self.gpu_start = self.timeline.mark() if self.timeline else None
            return taken

        graphs = self.graphs if h.max_query_len == 1 else self.verify_graphs.get(h.uniform_query_len)
        cascade = h.shared_kv_runs is not None and h.max_query_len == 1  # (verification graphs do without)
        if cascade:
            graphs = self.cascade_graphs
        if graphs is None and h.verify is not None and h.max_query_len in self.verify_graphs:
            padded = self.inputs.pad_queries(h, h.max_query_len)  # mixed draft counts: pad to one length
            if padded is not None:
                h, graphs = padded, self.verify_graphs[h.max_query_len]
        if rounds > 1 and graphs is not None and not self.commits_in_graph(graphs, h):
            graphs, h = None, built  # the rounds run eagerly, each drawn by the sampler
        if prompt is not None:
            graphs, h = None, built
        num_runs = len(h.shared_kv_runs.prefix_lens) if cascade else 0
        bs = graphs.padded_size(len(h.seq_lens), num_runs) if graphs is not None else None
        if bs is not None:  # every sequence decodes (or verifies k drafts): replay a captured graph
            return self._execute_graph(graphs, plan, h, bs, arrive, start, spec)
        if verifies_on_graph and h is built:  # no graph took it (nor padded it): attend with them
            self.inputs.attach_shared_kv_runs(plan, h)
        d, sampling = self.inputs.upload(h, eager=True)
        if spec is not None:  # a plan sent before a verification came back: move its sequences
            self.spec.stage(spec, h)
            self.spec.shift_eager(spec, d, sampling)
        # A plan with placeholders (decode lookahead) uploads each token's state row to resolve them.
        placeholders = (d["token_rows"], self.last_sampled) if "token_rows" in d else None
        # Later verification rounds move the sequences on (at most a round's tokens each).
        max_seq_len = min(int(h.seq_lens.max()) + (rounds - 1) * h.max_query_len, self.max_model_len)
        meta = AttentionMetadata(
            query_start_loc=d["query_start_loc"],
            seq_lens=d["seq_lens"],
            block_tables=d["block_tables"],
            slot_mapping=d["slot_mapping"],
            max_query_len=h.max_query_len,
            max_seq_len=max_seq_len,
            min_query_len=int(np.diff(h.query_start_loc).min()),
            shared_kv_runs=shared_kv_runs(h, d),
        )
        taken = arrive()
        tp = self.piecewise.padded_size(len(h.positions)) if self.piecewise is not None else None
        kept = []  # each verification round's (draws, packed result)
        for r in range(rounds):
            if r:
                self.spec.advance_eager(spec, d, sampling)
            if tp is not None:
                hidden, residual = self.piecewise.run(tp, d, meta, *taken)
            else:
                hidden, residual = self.shard.forward(
                    d.get("input_ids"), d["positions"], *taken, self.kv_caches, meta, placeholders=placeholders
                )
            if not self.is_last:
                return hidden, residual
            if prompt is not None and r == 0:  # (a prefill chunk runs one round)
                sharded = self.sampler if self.tp.active else None  # (its slices' statistics combined)
                prompt_tensors = prompt_logprobs(
                    self.compute_logits, hidden, residual, prompt, self.config.vocab_size, sharded
                )
                prompt = (prompt_tensors, prompt.num_top)
            logits = None
            if h.sample_seq_ids:  # (the head on a padded row count: step_inputs.LOGITS_ROWS_MULTIPLE)
                idx = d["logits_token_index"]
                logits = self.compute_logits(hidden[idx], residual[idx])[: len(h.sample_token_index)]
            if rounds == 1:
                return self.sample_result(plan, h, logits, d["sample_rows"], sampling, start, spec, prompt)
            out = self.sampler(logits, sampling)  # (_check_rounds: no logprobs, no controls)
            kept.append((out.token_ids, self.spec.after_draw(spec, out.token_ids, per_token=False)))
        draws, packed = (torch.stack(x) for x in zip(*kept))
        return self.rounds_result(plan, h, start, spec, draws, packed, prompt=prompt)

    def _asked_prompt_rows(self, plan, h: HostInputs, rows: np.ndarray) -> PromptRows | None:
        return asked_rows(plan, h.query_start_loc, self.table.prompt_logprobs[rows], self.config.vocab_size)

    def _check_rounds(self, h: HostInputs) -> None:
        """Several verification rounds in one step: one stage (the next round's inputs are the
        last stage's own tokens and drafts), and rows whose draw is the whole result (no logprobs;
        no penalties or grammar, whose state a later round's redraw of a finished row would move)."""
        if not (self.is_first and self.is_last):
            raise PlanError("several verify rounds need one pipeline stage")
        rows = h.token_rows
        if (self.table.logprobs[rows] >= 0).any() or (
            self.controls is not None and self.controls.controlled[rows].any()
        ):
            raise PlanError("several verify rounds do not serve logprobs, penalties or grammars")

    def decode_again(self) -> bool:
        """The latest step's decode graph replayed once more, each of its sequences fed the token
        it just drew, at the next position (a draft worker's proposal, draft_steps.py): the inputs
        move on the device, with no plan, upload or staging (most of a draft step's host time).
        False when the latest step cannot be replayed so: it ran eagerly,
        drew outside its graph, or attended with shared prefixes; or a sequence's next position
        lies in a block its staged table does not hold (step_inputs stages the blocks a step
        reaches; a plan then stages more)."""
        last = self.decode_graph_step
        if last is None or last.room <= 0:
            return False
        last.room -= 1
        last.graphs.move_on_one_token(last.num_seqs, self.block_size)
        last.graphs.replay(last.padded_size)
        return True

    def commits_in_graph(self, graphs, h: HostInputs) -> bool:
        """Whether a verification graph's own draw and commit take the step (every row drawn
        unfiltered): what several rounds on the graph need."""
        return getattr(graphs, "commits", False) and graphs.samples and bool(self.table.unfiltered[h.token_rows].all())

    def rounds_result(
        self, plan, h: HostInputs, start: float, spec, draws, packed, take=None, prompt=None
    ) -> PendingResult:
        """The result of a step of several verification rounds: draws [rounds, rows] and packed
        [rounds, n, 2 + max_k], each round's."""
        return PendingResult(
            plan.step_id,
            start,
            h.sample_seq_ids,
            self.table.logprobs[h.sample_rows],
            [draws],
            self.timeline,
            self.gpu_start,
            h.verify,
            take=take,
            speculation=(packed, spec.sample_idx),
            rounds=spec.seq_rounds,
            prompt=prompt,
        )

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """The head's logits: [N, V], or this rank's [N, vocab.local] slice with tensor parallelism."""
        return self.shard.compute_logits(hidden, residual)

    def _execute_graph(self, graphs, plan, h: HostInputs, bs: int, arrive, start: float, spec):
        return run_on_graph(self, graphs, plan, h, bs, arrive, start, spec)

    def sample_result(
        self,
        plan: engine_pb2.StepPlan,
        h: HostInputs,
        logits,
        sample_rows,
        sampling: SamplingTensors | None,
        start: float,
        spec=None,
        prompt=None,
    ) -> PendingResult:
        """prompt: the step's prompt logprobs (device tensors, each row's k), when it asked."""
        step_id = plan.step_id
        controlled = self.controls is not None and self.controls.active
        if controlled:  # after the forward's launch: its host work overlaps the GPU's
            self.controls.begin_step(plan, h)
        if not h.sample_seq_ids:
            return PendingResult(step_id, start, [], np.zeros(0), [], self.timeline, self.gpu_start, prompt=prompt)
        sampler = self.sampler
        if controlled and self.tp.active and self.controls.controlled[h.sample_rows].any():
            # Penalties and grammars on the whole rows, then the unsharded draw, as at T = 1.
            logits, sampler = self.sampler.all_gather_rows(logits), self.sampler.sampler
        if controlled:
            logits, grammar_rows = self.controls.apply(logits, h)
        out = sampler(logits, sampling)
        if controlled:
            self.controls.after_draw(h, out.token_ids, grammar_rows)
        # Kept on the device for the next plan's decode lookahead (placeholder input tokens).
        self.last_sampled[sample_rows] = out.token_ids
        # Speculation on the device: verify, commit the emitted tokens, propose the next drafts.
        packed = self.spec.after_draw(spec, out.token_ids, per_token=False) if spec is not None else None
        tensors = [out.token_ids]
        if sampling.num_logprobs >= 0:
            tensors += [out.logprobs, out.top_ids, out.top_logprobs]
        return PendingResult(
            step_id,
            start,
            h.sample_seq_ids,
            self.table.logprobs[h.sample_rows],
            tensors,
            self.timeline,
            self.gpu_start,
            h.verify,
            speculation=(packed, spec.sample_idx) if packed is not None else None,
            prompt=prompt,
        )

"""A plan's result applied: the sampled tokens checked against the plan, appended to their
requests (stop checks included), and a verify step's outcome handed to speculation's
verification (rollback, acceptance, k). Part of the Scheduler (scheduler.py), as a mixin over the
core's state."""

from __future__ import annotations

from strata.protocol import DEVICE_DRAFT
from strata.services.scheduler.plan import RequestUpdate, ScheduledSeq, StepPlan
from strata.services.scheduler.request import Request, RequestStatus
from strata.services.scheduler.speculation.verification import verified
from strata.services.scheduler.stop import check_stop
from strata.v1 import engine_pb2

_RUNNING = engine_pb2.FINISH_REASON_UNSPECIFIED


class ResultUpdates:
    """The Scheduler's intake of plan results (module docstring)."""

    def update(
        self,
        plan: StepPlan,
        sampled: dict[int, list[int]],
        proposals: dict[int, list[int]] | None = None,
        rounds: dict[int, tuple[list[int], list[int]]] | None = None,
    ) -> list[RequestUpdate]:
        """Applies a plan's result: sampled[seq_id] holds the tokens of every sequence that
        sampled (1, or accepted drafts + 1, per verify round); proposals[seq_id] the drafts the
        last stage proposed after the step (device prompt lookup); rounds[seq_id] what each verify
        round emitted and proposed (plan_codec.split_rounds). Sequences aborted since the plan are
        ignored. An update's new_token_ids may be the list from `sampled` itself."""
        self.retire(plan)
        live: list[ScheduledSeq] = []
        for s in plan.seqs:  # validate everything before changing anything
            req = s.request
            if req.seq_id != s.seq_id or not req.in_flight:
                continue  # aborted, or finished by a stop, since the plan was built
            live.append(s)
            if not s.sample:
                continue
            tokens = sampled.get(s.seq_id)
            num_draft = s.num_draft
            most = s.rounds * (num_draft + 1)
            if tokens is None or not 1 <= len(tokens) <= most:
                raise ValueError(f"step {plan.step_id}: seq {s.seq_id} needs 1..{most} tokens, got {tokens!r}")
            if num_draft and s.input_token_ids[-1] != DEVICE_DRAFT:  # drafts the plan carried
                accepted = len(tokens) - 1
                if tokens[:accepted] != s.input_token_ids[-num_draft:][:accepted]:
                    raise ValueError(f"step {plan.step_id}: seq {s.seq_id} accepted tokens differ from its drafts")

        updates: list[RequestUpdate] = []
        self._num_in_flight -= len(live)
        spec = self.spec
        if spec is not None:
            spec.verifying_plans -= plan.verifies
        for s in live:
            req = s.request
            req.in_flight -= 1
            if not s.sample:
                continue
            tokens = sampled[s.seq_id]
            state = req.spec
            state.max_pending -= s.rounds * (s.num_draft + 1)
            if s.num_draft:
                verified(
                    req,
                    s,
                    len(tokens),
                    rounds.get(s.seq_id) if rounds else None,
                    self.block_manager,
                    self.acceptance,
                    self.spec,
                )
            if proposals is not None:
                found = proposals.get(s.seq_id, ())
                state.last_proposed = len(found)
                # Drafts for the next plan (P stages, controls): only if none is in flight.
                state.returned = list(found) if not req.in_flight and not state.on_device else []
            updates.append(self._append_tokens(req, tokens))
        return updates

    def update_one_token_each(
        self, plan: StepPlan, seq_ids: list[int], tokens: list[int]
    ) -> tuple[list[Request], list[int], list[RequestUpdate]] | None:
        """update() fused for the commonest result: a plan whose every sequence sampled one token
        (no drafts, no prompt chunk that samples nothing), listed in the plan's order, without
        speculation. One loop, no {seq_id: tokens} map, and no RequestUpdate for a request that
        goes on running (pipelined decode runs this for every sequence of every plan). Returns
        (the requests that go on running, their new tokens, the updates of the others: ended, or
        checked against their stop tokens); the same state and updates as update() (tests compare
        the two). None when the result is not of that kind: the caller then takes update()."""
        seqs = plan.seqs
        if not self.fast_paths or self.spec is not None or len(tokens) != len(seqs) or plan.has_drafts:
            return None
        if seq_ids != (plan.repeat[0] if plan.repeat else [s.seq_id for s in seqs]):  # (the sampling ones, in order)
            return None
        self.retire(plan)
        running: list[Request] = []
        running_tokens: list[int] = []
        others: list[RequestUpdate] = []
        live = 0
        for s, token in zip(seqs, tokens):
            req = s.request
            if req.seq_id != s.seq_id or not req.in_flight:
                continue  # aborted, or finished by a stop, since the plan was built
            live += 1
            req.in_flight -= 1
            req.spec.max_pending -= 1
            out = req.output_token_ids
            if token in req.stop_check_ids or len(out) + 1 >= req.max_output_tokens:
                others.append(self._append_tokens(req, [token]))  # (it may end: the stop and length checks)
                continue
            out.append(token)
            running.append(req)
            running_tokens.append(token)
        self._num_in_flight -= live
        return running, running_tokens, others

    def _append_tokens(self, req: Request, tokens: list[int]) -> RequestUpdate:
        out = req.output_token_ids
        if self.fast_paths and len(tokens) == 1 and tokens[0] not in req.stop_check_ids:
            # One token that cannot stop the request (most steps): of check_stop's rules, only
            # the length applies.
            new = tokens  # all of it is new: no copy (update() never changes the caller's lists)
            out.append(tokens[0])
            status = RequestStatus.FINISHED_LENGTH if len(out) >= req.max_output_tokens else None
        else:
            kept, status, stop_token_id = check_stop(req, len(out), tokens)
            new = tokens[:kept]  # tokens after a stop are dropped
            out.extend(new)
            if stop_token_id is not None:
                req.stop_token_id = stop_token_id
        if status is None:
            return RequestUpdate(req, new, False, _RUNNING, None)
        self._finish(req, status)
        return RequestUpdate(req, new, True, status.value, req.stop_token_id)

"""Speculative decoding on the worker: the verification rows of a step and their outcome
(verification.py), prompt lookup, verification and the moves of plans sent ahead on the last
stage's device (device_speculation.py, with the meta rows it stages in meta_staging.py and the
graphs that commit in the graph in speculating_graphs.py), and a draft worker's proposal of k
tokens (draft_steps.py). The scheduler's half is services/scheduler/speculation/; the kernels
that verify, commit and shift on the GPU are kernels/spec_decode.py, and kernels/ngram_lookup.py
proposes (kernels live in kernels/).

Glossary (the same words in both services):
- proposal: the drafts a proposer offers for a sequence's next step (prompt lookup's
  continuation of a repeated n-gram, or a draft model's k tokens);
- draft: one proposed token; a verify step carries up to k of them after the latest token;
- verify step: a step that computes the latest token plus its d drafts and draws a token at each
  of those d + 1 positions (d + 1 sample rows); verify rounds run several in one plan;
- accepted: a draft equal to the target's own draw at its position, counted left to right up to
  the first that is not;
- bonus token: the draw at the first mismatch, or after the last draft when all were accepted,
  so that every verify step emits accepted + 1 tokens;
- rollback: the rejected drafts' KV slots given back (the scheduler's), and on the device the
  positions, slots and lengths of a plan sent before the result moved back by the drafts
  rejected meanwhile (kernels/spec_decode.py's shifts).

Why a draft is accepted exactly when it equals the target's own (seed, position) draw: every
draw takes its noise from the sequence's seed and the position of the token it draws
(counter-based Gumbel-max, kernels/gumbel_sampling.py), never from a generator's state, so the
draw of sample row j of a verify step is the token a plain decode step at that position would
draw from the same prefix, and the prefix is the same as long as drafts 0 .. j - 1 were accepted.
Accepting each draft that equals that draw, and emitting the draw itself at the first mismatch,
gives plain decoding's tokens whatever was proposed: a proposal changes how many tokens a step
emits, never which (exactly in float32; in bf16 a verify step may round a near-tie differently
from a decode step). A draft model drawing with the same (seed, position) noise on its own
logits is coupled to the target's draws; its acceptance is measured against the
rejection-sampling optimum, 1 - TV(p, q).
"""

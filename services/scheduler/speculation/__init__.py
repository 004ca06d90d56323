"""Speculative decoding in the scheduler: who proposes drafts and for whom (proposals.py, with
prompt lookup in ngram_proposer.py and a draft model's worker in draft_proposer.py), the slots a
verify step takes and their rollback (verification.py), each request's k (adaptive_k.py), and the
cost model that decides per step whether verifying pays (cost_model.py). The worker's half is
services/worker/speculation/; on the GPU, kernels/spec_decode.py verifies and commits and
kernels/ngram_lookup.py proposes (kernels live in kernels/).

Glossary (the same words in both services):
- proposal: the drafts a proposer offers for a request's next step (prompt lookup's
  continuation of a repeated n-gram, or a draft model's k tokens);
- draft: one proposed token; a verify step carries up to k of them after the request's latest
  token;
- verify step: a step that computes the latest token plus its d drafts (d + 1 positions of KV)
  and draws a token at each of those d + 1 positions; with verify rounds, the last stage runs
  several of them in one plan;
- accepted: a draft equal to the target's own draw at its position, counted left to right up to
  the first that is not;
- bonus token: the draw at the first mismatch, or after the last draft when all were accepted,
  so that every verify step emits accepted + 1 tokens;
- rollback: the KV slots (and blocks past them) of rejected drafts given back when the result
  comes back; on the device, a plan sent before that result moves its sequences back by the
  drafts rejected meanwhile.

Why a draft is accepted exactly when it equals the target's own (seed, position) draw: every
draw, with or without speculation, takes its noise from the request's seed and the position of
the token it draws (counter-based Gumbel-max, kernels/gumbel_sampling.py), never from a
generator's state. The verify step's draw at position p is therefore the token a plain decode
step at p would draw from the same prefix, and the prefix is the same as long as every draft
before p was accepted. Accepting each draft that equals that draw, and emitting the draw itself
at the first mismatch, reproduces plain decoding token for token whatever was proposed: a
proposal changes how many tokens a step emits, never which (exactly in float32; in bf16 a verify
step may round a near-tie differently from a decode step). No rejection-sampling test is needed
for exactness; a draft model that draws with the same (seed, position) noise on its own logits
is coupled to the target's draws, and its acceptance is measured against the rejection-sampling
optimum, 1 - TV(p, q).
"""

"""Constants of the internal step protocol (protos/strata/v1/engine.proto) shared by services."""

# An input token of a StepPlan that the scheduler does not know yet (decode lookahead): the token
# the worker sampled last for that sequence, which it still holds on the device.
PLACEHOLDER_TOKEN = -1

# Temperatures below this sample greedily (as in vLLM): dividing logits by ~0 would overflow. The
# gateway resolves such a temperature to 0; the last stage applies the same rule to whatever it
# is sent.
GREEDY_TEMPERATURE = 1e-5

# Most top logprobs a request may ask for per token (vLLM's default max_logprobs): the last stage
# ranks that many tokens per row.
MAX_LOGPROBS = 20

# A draft token the draft model has not proposed yet: the scheduler's plan holds it until the
# draft worker's tokens replace it, before the plan goes out.
DRAFT_PLACEHOLDER = -2

# A draft token that the last stage proposed by prompt lookup and keeps on its device: a
# verifying sequence's draft j reads that worker's draft j for the sequence (one pipeline stage;
# services/worker/speculation/device_speculation.py). With a draft model (StepPlan.linked_drafts) the draft
# worker hands them to that stage over the draft link (services/worker/transport/token_handoff.py).
DEVICE_DRAFT = -3

# Verification rounds one step may run at most (StepPlan.verify_rounds): the scheduler's limit on
# --speculative-rounds and the worker's check of a plan.
MAX_VERIFY_ROUNDS = 16

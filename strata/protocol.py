"""Constants of the internal step protocol (protos/strata/v1/engine.proto) shared by services."""

# An input token of a StepPlan that the scheduler does not know yet (decode lookahead): the token
# the worker sampled last for that sequence, which it still holds on the device.
PLACEHOLDER_TOKEN = -1

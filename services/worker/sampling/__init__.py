"""The last stage's draw from the logits: the sampler (`sampler.py`: greedy, temperature,
top-k/top-p/min-p and logprobs, every draw from (seed, position) noise), and the controls some
sequences ask for before it (`sampling_controls.py`, over `penalties.py`: presence, frequency and
repetition penalties, logit bias, bad words, allowed tokens; and `grammar.py`: xgrammar matchers
and their token bitmasks). The options themselves are checked once at plan intake, by
`strata/sampling_rules.py`. With tensor parallelism, `sharded.py` draws exactly the same tokens
from a rank's slice of the logits (the vocabulary split over the stage's ranks). Prompt logprobs
land here.
"""

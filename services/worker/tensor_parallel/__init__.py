"""Tensor parallelism within a stage: the stage's T ranks (one process per GPU) run every plan
together, each holding a slice of every layer's heads and of the vocabulary.

    group.py      the ranks' process group (NCCL on GPUs, gloo on CPUs) and its collectives
                  (all_reduce_, all_reduce_max_, all_gather), each with a deadline; no-ops at T = 1
    vocab.py      a rank's slice of the vocabulary (padded to whole bitmask words)

The sampler's exact draw over vocabulary slices is sampling/sharded.py.
"""

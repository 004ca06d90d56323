"""Tensor parallelism within a stage: the stage's T ranks (one process per GPU) run every plan
together, each holding a slice of every layer's heads and MLP and of the vocabulary, with one
all-reduce after each row-parallel linear. Rank 0 speaks for the stage: the scheduler sees one
stage per pipeline position, and rank 0 relays its plans and links to the other ranks.

    group.py       the ranks' process group (NCCL on GPUs, gloo on CPUs and on GPUs ranks share)
                   and its collectives (all_reduce_, all_reduce_max_, all_gather), each with a
                   deadline; no-ops at T = 1
    symm_mem.py    the one-shot all-reduce of small messages through symmetric memory (opt-in)
    ipc_all_reduce.py  Strata's own one-shot (kernels/one_shot_all_reduce.py) over buffers shared
                   by CUDA IPC, and the abort word that frees its waits (the default on GPUs)
    rendezvous.py  the store rank 0 hosts, where the ranks find each other
    relay.py       rank 0's side: its peers described, InitCache and token links relayed with each
                   rank's own link ends
    plan_socket.py every plan's bytes from rank 0 to each peer, on a socket of their own
    ranks.py       a worker's place in its stage, as the Worker service uses it
    vocab.py       a rank's slice of the vocabulary (padded to whole bitmask words)

The sampler's exact draw over vocabulary slices is sampling/sharded.py; the rank's slice of the
model (its linears, embedding and head) is model/sharding.py's.
"""

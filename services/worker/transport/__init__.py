"""Stage links: how a step's activations reach the next stage, and how the last stage's sampled
tokens (or a draft worker's proposals) reach stage 0, device to device. `stage_transport.py` has
the two ends every link shares and opens them; `ipc_transport.py` (a ring in CUDA IPC or
/dev/shm memory, ordered by `ring.py`'s events or slot words), `distributed_transport.py`
(torch.distributed send/recv) and gRPC carry the bytes; `doorbell.py` announces each step between
the two step threads; `stream_memops.py` lets a GPU wait on a word in host memory;
`token_handoff.py` (the order), `token_link_ends.py` (its receivers and senders) and
`token_waits.py` close the pipelined-decode loop from the last stage back to stage 0. What the
scheduler also needs about links (where a worker runs, which transport a link takes, their
errors) lives in `strata/stage_links.py`. With tensor parallelism every rank of a
stage has its own links, to the ranks of its number in the next stage and (the token link) in
stage 0; the stage's own group is the tensor_parallel room's.
"""

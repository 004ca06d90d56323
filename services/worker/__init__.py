"""The worker: one process per GPU of a pipeline stage, serving the Worker service.

`main.py` builds the stage (device, shard, KV cache size) and serves it, `server.py` is the gRPC
surface (plans in, results out, the stage links set up), and `runner.py` runs one plan's step.
Everything else lives in a room of its own:

    transport/    how activations and sampled tokens move between stages (ipc, distributed, gRPC)
    model/        the model: layers, the stage's shard, its config, weights and attention backends
    sampling/     the last stage's draw: the sampler, penalties, grammars and their controlled draw
    step/         one step's state and data: the sequence table, inputs, results, the step thread
    graphs/       CUDA graphs (decode, verification, piecewise) and the warm-up before serving
    speculation/  speculative decoding on the device: drafts, verification, a draft worker's steps
    device/       the worker's own calls into CUDA: driver calls that keep the GIL, uploads
    diagnostics/  what a stage measures about itself: GPU clock stamps, profiles, busy and idle

    tensor_parallel/  a stage's ranks: their group and collectives, rank 0's relay to the others

Tensor parallelism's sharded linears are the model's (model/), its exact draw over vocabulary
slices the sampler's (sampling/sharded.py).
"""

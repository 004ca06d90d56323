"""CUDA graphs: decode graphs (also verification graphs of k + 1 tokens per sequence) that stage
their own inputs and may draw in the graph (`cuda_graphs.py`), piecewise graphs for mixed steps
with attention launched between the pieces (`piecewise_graphs.py`), and the warm-up that compiles
every kernel a step may launch before the stage serves (`warm_up.py`). The speculating variants
of the decode graphs live in `speculation/speculating_graphs.py`.
"""

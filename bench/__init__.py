"""`strata bench`: benchmarks that drive the full service stack (gateway -> scheduler -> workers).

Each module is one benchmark: offline (throughput), serving (latency), parallel_sampling,
roofline (decode step against its memory floor) and hf_baseline (HF transformers generate()).
common holds what they share: the cluster, load generators over grpc.aio, stats and output.
"""

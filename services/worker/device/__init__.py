"""The worker's own calls into CUDA: driver calls that keep the GIL where torch's would give it
away (`cuda_driver.py`: events, graph launches, copies on a stream), and one upload per step of
the host's numpy arrays through pinned memory (`host_to_device.py`).
"""

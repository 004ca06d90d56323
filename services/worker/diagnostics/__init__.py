"""What a stage measures about itself: busy and idle time per step from CUDA events
(`stage_stats.py`, for WorkerStats), a window of steps under torch.profiler (`profiling.py`,
--profile-output), and stamps of each step on the GPU's global clock, placed against the other
stages' (`gpu_clock.py`, --gpu-clock-dir). None of them changes what a step computes.
"""

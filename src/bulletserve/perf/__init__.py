"""Performance model: op inventory, hardware profiles, calibrated roofline.

`inventory`, `hardware`, `interp` and `model` are pure (no torch, threads or I/O beyond reading
a profile file) so that the scheduler and the simulator can call `PerfModel.predict` freely.
The measuring code lives in bulletserve.profiling (`bullet profile`) and
bulletserve.partition.measure (the micro-benchmarks), and imports torch.
"""

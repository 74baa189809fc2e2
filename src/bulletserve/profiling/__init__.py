"""The measuring rig behind `bullet profile`: it drives the model runner and the engine to time
real steps, the sampler and the host's work between steps, and fits the performance model
(bulletserve.perf, which stays pure) to them. It sits above the engine; the micro-benchmarks an
engine takes at start without a profile are bulletserve.partition.measure."""

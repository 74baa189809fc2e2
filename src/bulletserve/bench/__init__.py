"""`bullet bench`: workloads, arrival processes, a streaming load client, metrics and plots.

Metrics follow vLLM's `benchmark_serving` definitions, so numbers taken against bulletserve,
vLLM and SGLang with the same command mean the same thing. See docs/benchmarking.md.
"""

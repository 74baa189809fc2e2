"""Errors of the partitioners (torch-free, so pure code can name them)."""


class UnitsUnavailableError(RuntimeError):
    """The device cannot be partitioned (no CUDA, no green contexts, too few SMs)."""

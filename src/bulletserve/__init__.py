"""bulletserve: LLM serving with concurrent prefill and decode lanes (Bullet)."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from bulletserve.engine.llm import LLM
    from bulletserve.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> object:
    # Imported on first use, so that pure parts (sched/, perf/, bench/) load without torch.
    if name == "LLM":
        from bulletserve.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from bulletserve.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'bulletserve' has no attribute {name!r}")

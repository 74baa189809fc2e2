"""bulletserve: LLM serving with concurrent prefill and decode lanes (Bullet)."""

from bulletserve.engine.llm import LLM
from bulletserve.engine.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "__version__"]

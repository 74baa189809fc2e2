"""bulletserve: LLM serving with concurrent prefill and decode lanes (Bullet)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

# PyTorch's CPU thread pool is GNU OpenMP, which cuts its workers' spin-wait to 100 iterations
# once it manages more threads than there are cores; two thread teams (two lanes, or a loader
# thread and a compute thread) are enough on a 2-core machine, and every parallel op then pays
# a futex wake-up (measured 31 us per small op instead of 16-19 us). An active wait policy
# raises that floor to 1000 spins. The spin count keeps the ordinary wait there too before a
# worker sleeps: libgomp's default (300,000, about 3 ms) left a server that shares its cores
# with another busy process spinning while the thread it waited for was descheduled (a burst
# 6-15x slower than alone; with 1000, 1.9x, and alone within 2%: docs/benchmarks.md, "Threads
# on shared cores"). It takes effect only if torch is not loaded yet, and never over the
# user's own OpenMP settings.
if "torch" not in sys.modules and not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & set(os.environ):
    os.environ["OMP_WAIT_POLICY"] = "active"
    os.environ["GOMP_SPINCOUNT"] = "1000"

# oneDNN builds (JIT-compiles) a GEMM kernel for every row count and thread count it meets and
# keeps 1,024 of them; a CPU engine builds those of every padded row count up to
# --cpu-warmup-rows at start (a two-lane one at each thread count a lane may use), more come as
# longer steps arrive, and a full cache would evict the warmed ones. Read when the first
# kernel is built, so this works after torch has loaded too.
os.environ.setdefault("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "4096")

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from bulletserve.engine.llm import LLM
    from bulletserve.engine.lora import LoRARequest
    from bulletserve.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> object:
    # Imported on first use, so that pure parts (sched/, perf/, bench/) load without torch.
    if name == "LLM":
        from bulletserve.engine.llm import LLM

        return LLM
    if name == "LoRARequest":
        from bulletserve.engine.lora import LoRARequest

        return LoRARequest
    if name == "SamplingParams":
        from bulletserve.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'bulletserve' has no attribute {name!r}")

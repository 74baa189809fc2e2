"""Which part of each weight a tensor-parallel rank holds (Megatron-LM's layout, as vLLM's).

Column-parallel (split along the output rows): q, k and v by heads, gate and up by MLP
columns, the LM head by vocabulary. Row-parallel (split along the input columns): o_proj and
down_proj, whose partial outputs the ranks sum with one all-reduce each. Everything else
(embedding, norms, q/k norms) is whole on every rank. A fused weight (qkv_proj, gate_up_proj)
is split section by section, so a rank's fused weight is its q, k and v one above the other.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from bulletserve.dist.parallel import Shard
from bulletserve.model.config import ModelConfig


@dataclass(frozen=True)
class Split:
    """How a weight is cut: along `dim`, each of its `sections` (the full tensor's parts along
    that dim, in order) into equal shares per rank (`padded`: ceil shares, the last shorter)."""

    dim: int
    sections: tuple[int, ...]
    padded: bool = False

    def ranges(self, shard: Shard) -> list[tuple[int, int]]:
        """This rank's [start, end) ranges along `dim` of the full tensor, one per section."""
        out, offset = [], 0
        for size in self.sections:
            start, end = shard.padded_range(size) if self.padded else shard.range(size)
            out.append((offset + start, offset + end))
            offset += size
        return out

    def take(self, full: torch.Tensor, shard: Shard) -> torch.Tensor:
        """This rank's part of the full tensor."""
        parts = [full.narrow(self.dim, start, end - start) for start, end in self.ranges(shard)]
        return parts[0] if len(parts) == 1 else torch.cat(parts, self.dim)


_LAYER_WEIGHT = re.compile(r"^(?:model\.)?layers\.\d+\.(?:self_attn|mlp)\.(\w+)\.(weight|bias)$")


def weight_split(name: str, config: ModelConfig) -> Split | None:
    """How the weight `name` is split over ranks (our fused names or Hugging Face's unfused
    ones), or None where every rank holds it whole."""
    if name in ("lm_head.weight", "model.lm_head.weight"):
        return Split(0, (config.vocab_size,), padded=True)
    match = _LAYER_WEIGHT.match(name)
    if match is None:
        return None
    module, kind = match.groups()
    q, kv, i = config.q_size, config.kv_size, config.intermediate_size
    rows = {
        "q_proj": (q,),
        "k_proj": (kv,),
        "v_proj": (kv,),
        "qkv_proj": (q, kv, kv),
        "gate_proj": (i,),
        "up_proj": (i,),
        "gate_up_proj": (i, i),
    }
    if module in rows:
        return Split(0, rows[module])
    if module in ("o_proj", "down_proj") and kind == "weight":
        return Split(1, (q if module == "o_proj" else i,))
    return None

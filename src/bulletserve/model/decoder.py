"""Our decoder for the Llama, Mistral, Qwen2 and Qwen3 families, run from a paged KV cache.

Weights are stored fused (q/k/v in one projection, gate/up in another) so that each layer does
two large GEMMs instead of five small ones. `load_hf_weights` takes Hugging Face tensor names.
The residual stream is carried beside each layer's output (as in vLLM) so that the residual add
and the next RMSNorm are one fused op; on the CPU, `use_fused_ops` turns our C kernels on for
those (keeping the stream in fp32), RoPE and SiLU * up, and every module keeps its PyTorch path
for other devices. `use_packed_linear` packs the projection weights once for a CPU GEMM (oneDNN's
or our blocked fp32 one, whichever the loader found fastest) and runs every projection through
it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from bulletserve.dist.parallel import TensorParallel
from bulletserve.model.attention import AttentionMetadata, paged_attention
from bulletserve.model.config import ModelConfig, RopeScaling
from bulletserve.model.cpu_kernels import FusedOps, LinearKernel
from bulletserve.model.lora import LoRABatch
from bulletserve.model.quantized import PackedPart, QuantizedLinearKernel, QuantizedWeight


class Linear(nn.Linear):
    """nn.Linear that can hand its weight over to a packed CPU GEMM, or hold a quantized
    checkpoint's packed blocks in its place."""

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.kernel: LinearKernel | None = None
        self.quantized: QuantizedWeight | None = None
        self.quantized_kernel: QuantizedLinearKernel | None = None

    def reset_parameters(self) -> None:
        """Nothing: every weight is read from a file or drawn by the loader (`DecoderLM`'s
        modules). PyTorch's own init, on the meta tensors a model is laid out on, imports
        torch._dynamo: 1.5 s of every start."""

    def use_quantized(self, weight: QuantizedWeight, kernel: QuantizedLinearKernel) -> None:
        """Run on `weight`'s packed blocks through `kernel` from now on (the float weight,
        never filled, is dropped)."""
        if (weight.out_features, weight.in_features) != (self.out_features, self.in_features):
            raise ValueError(
                f"quantized weight [{weight.out_features}, {weight.in_features}] does not fit "
                f"a [{self.out_features}, {self.in_features}] projection"
            )
        del self.weight
        self.quantized, self.quantized_kernel = weight, kernel

    def use_packed(self, kernel: LinearKernel) -> None:
        """Replace the weight with its packed form and run through `kernel` from now on. One-way:
        the [out, in] weight is freed (memory stays that of one copy)."""
        packed = kernel.pack(self.weight.detach())
        del self.weight
        self.register_buffer("packed_weight", packed, persistent=False)
        self.kernel = kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quantized_kernel is not None:
            return self.quantized_kernel(x, self.quantized, self.bias)
        if self.kernel is not None:
            return self.kernel(x, self.packed_weight, self.out_features, self.bias)
        return F.linear(x, self.weight, self.bias)


class LMHead(nn.Module):
    """The LM head's weight, [vocab, hidden]: `DecoderLM` computes with it (its logits, a
    packed copy), never as a module, so it is laid out without an init."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops: FusedOps | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops is not None and x.dim() == 2 and x.is_contiguous():
            return self.ops.rmsnorm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def start(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(x), the residual stream starting at x). With fused ops the stream is kept
        in fp32 (a copy), so that bf16 rounding does not accumulate across layers."""
        if self.ops is not None and x.is_contiguous():
            residual = x.float()
            return self.ops.add_rmsnorm(None, residual, self.weight, self.eps), residual
        return self.forward(x), x

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x), residual + x); a stream from `start` is updated in place."""
        if self.ops is not None and residual.dtype == torch.float32 and x.is_contiguous():
            return self.ops.add_rmsnorm(x, residual, self.weight, self.eps), residual
        total = residual + x
        return self.forward(total.to(x.dtype)), total


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    # Computed on the host whatever device a model is laid out on: PyTorch's ops on the meta
    # device (see `Linear.reset_parameters`) import torch._dynamo.
    dims = torch.arange(0, head_dim, 2, dtype=torch.float64, device="cpu")
    inv_freq = 1.0 / (theta ** (dims / head_dim))
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between
        # interpolated smoothly.
        old_len = scaling.original_max_position_embeddings
        low_wavelen = old_len / scaling.low_freq_factor
        high_wavelen = old_len / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_len / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


@dataclass
class StepRope:
    """RoPE inputs of one step, shared by every layer."""

    positions: torch.Tensor
    # With fused ops: the fp32 tables [max_positions, D / 2]; else gathered [T, 1, D / 2].
    cos: torch.Tensor
    sin: torch.Tensor
    ops: FusedOps | None

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D]; the fused path rotates x in place (a fresh projection output)."""
        if self.ops is None or x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
            return apply_rope(x, self.cos, self.sin)
        self.ops.rope_(x, self.positions, self.cos, self.sin)
        return x


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position; a step gathers its rows once (or the fused kernel
    reads them by position)."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.ops: FusedOps | None = None
        inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling).float()
        positions = torch.arange(max_positions, dtype=torch.float32, device="cpu")
        freqs = torch.outer(positions, inv_freq)
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> StepRope:
        if self.ops is not None:
            return StepRope(positions, self.cos, self.sin, self.ops)
        cos = self.cos.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin.index_select(0, positions).to(dtype).unsqueeze(1)
        return StepRope(positions, cos, sin, None)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE (the Hugging Face layout). x: [T, heads, D]; cos, sin: [T, 1, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    """`config`: this rank's share (`ModelConfig.sharded`); o_proj's partial sums are added
    up over the ranks."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, layer: int = 0) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.layer = layer  # its index, for a LoRA adapter's updates
        self.qkv_proj = Linear(
            config.hidden_size, config.q_size + 2 * config.kv_size, bias=config.attention_bias
        )
        self.o_proj = Linear(config.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.scale = config.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        rope: StepRope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        c = self.config
        lora = meta.lora
        qkv = self.qkv_proj(x)
        if lora is not None:
            qkv = lora.add(qkv, x, self.layer, "qkv")
        q, k, v = qkv.split([c.q_size, c.kv_size, c.kv_size], dim=-1)
        q = q.view(-1, c.num_heads, c.head_dim)
        k = k.view(-1, c.num_kv_heads, c.head_dim)
        v = v.view(-1, c.num_kv_heads, c.head_dim)
        if c.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        q = rope.apply(q)
        k = rope.apply(k)
        out = paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale)
        out = out.reshape(-1, c.q_size)
        projected = self.o_proj(out)
        if lora is not None:
            projected = lora.add(projected, out, self.layer, "o")
        return self.tp.all_reduce(projected)


class MLP(nn.Module):
    """`config`: this rank's share of the columns; down_proj's partial sums are added up over
    the ranks."""

    def __init__(self, config: ModelConfig, tp: TensorParallel, layer: int = 0) -> None:
        super().__init__()
        self.tp = tp
        self.layer = layer  # its index, for a LoRA adapter's updates
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.ops: FusedOps | None = None

    def forward(self, x: torch.Tensor, lora: LoRABatch | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            gate_up = lora.add(gate_up, x, self.layer, "gate_up")
        if self.ops is not None:
            hidden = self.ops.silu_mul(gate_up)
        else:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            hidden = F.silu(gate) * up
        out = self.down_proj(hidden)
        if lora is not None:
            out = lora.add(out, hidden, self.layer, "down")
        return self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, tp, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp, layer)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: StepRope,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's MLP output, the residual stream before it); their sum is the
        layer's output. Without a residual, x is the whole stream."""
        if residual is None:
            normed, residual = self.input_layernorm.start(x)
        else:
            normed, residual = self.input_layernorm.add_forward(x, residual)
        x = self.self_attn(normed, rope, kv_cache, meta)
        normed, residual = self.post_attention_layernorm.add_forward(x, residual)
        return self.mlp(normed, meta.lora), residual


class LogitsBuffer:
    """Memory for one caller's fp32 logits, reused from step to step. On a CPU, glibc serves an
    allocation of over 32 MB from fresh pages every time, and a [rows, vocab] fp32 matrix is
    that large from about 170 rows of a 49K vocabulary (64 of a 128K one): converting 256 rows
    of bf16 logits took 15 ms into a new tensor, 1.6 ms into reused memory. A caller (a lane)
    uses the logits of one step before it asks for the next."""

    def __init__(self) -> None:
        self._memory = torch.empty(0, dtype=torch.float32)

    def memory(self, rows: int, columns: int, device: torch.device) -> torch.Tensor:
        """fp32 [rows, columns] in this buffer's memory (grown when too small)."""
        if self._memory.numel() < rows * columns or self._memory.device != device:
            self._memory = torch.empty(rows * columns, dtype=torch.float32, device=device)
        return self._memory[: rows * columns].view(rows, columns)

    def fp32(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` converted to fp32, in this buffer's memory."""
        return self.memory(logits.shape[0], logits.shape[1], logits.device).copy_(logits)


class DecoderLM(nn.Module):
    """A decoder-only LM. A step: `embed`, `run_layers` over one or more layer groups, `logits`.

    Under tensor parallelism (`tp` of several ranks) this is one rank's shard: its heads and MLP
    columns (`shard_config`), the whole embedding, and its share of the vocabulary in the LM
    head (a slice of the embedding where they are tied); `logits` gathers the whole rows on
    rank 0."""

    def __init__(
        self, config: ModelConfig, max_positions: int, tp: TensorParallel | None = None
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp or TensorParallel()
        self.shard_config = config.sharded(self.tp.size)
        self.vocab_range = self.tp.shard.padded_range(config.vocab_size)
        # Laid out without PyTorch's init (see `Linear.reset_parameters`).
        self.embed_tokens = nn.Embedding(
            config.vocab_size,
            config.hidden_size,
            _weight=torch.empty(config.vocab_size, config.hidden_size),
        )
        self.layers = nn.ModuleList(
            DecoderLayer(self.shard_config, self.tp, index) for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)
        if not config.tie_word_embeddings:
            self.lm_head = LMHead(config.hidden_size, self.local_vocab_size)
        self.packed_linear: LinearKernel | None = None
        # A quantized checkpoint's packed embedding and LM head (`use_quantized_weights`).
        self.quantized_kernel: QuantizedLinearKernel | None = None
        self.quantized_embedding: QuantizedWeight | None = None
        self.quantized_lm_head: QuantizedWeight | None = None

    def reset_rotary(self, device: torch.device, max_positions: int) -> None:
        """Rebuild the cos/sin tables on `device` (after construction on the meta device)."""
        self.rotary = RotaryEmbedding(self.config, max_positions).to(device)

    def use_fused_ops(self, ops: FusedOps | None) -> None:
        """Run the element-wise chains through our fused CPU kernels (None: PyTorch ops)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, RotaryEmbedding, MLP)):
                module.ops = ops

    def use_packed_linear(self, kernel: LinearKernel) -> None:
        """Pack every float projection's weight, the LM head's too, for the packed CPU GEMM;
        one-way (a tied LM head keeps the embedding and gets a packed copy)."""
        for module in self.modules():
            if isinstance(module, Linear) and module.quantized is None:
                module.use_packed(kernel)
        if self.quantized_lm_head is None:
            self.register_buffer(
                "packed_lm_head", kernel.pack(self.lm_head_weight.detach()), persistent=False
            )
            if not self.config.tie_word_embeddings:
                del self.lm_head
            self.packed_linear = kernel

    @torch.inference_mode()
    def use_quantized_weights(
        self, packed: dict[str, PackedPart], kernel: QuantizedLinearKernel
    ) -> list[tuple[str, torch.Tensor]]:
        """Take a quantized checkpoint's packed matrices (Hugging Face names) as they are: the
        projections, the embedding (rows unpacked as a step looks them up) and the LM head (the
        embedding's blocks where tied). Returns, unpacked to fp32 for `load_hf_weights`, the
        parts of fused projections that cannot run packed because another part of the same
        projection came as floats."""
        self.quantized_kernel = kernel
        modules = dict(self.named_modules())
        fused: dict[str, dict[str, PackedPart]] = {}
        for hf_name, part in packed.items():
            name = _our_name(hf_name)
            match = _FUSED.match(name or "")
            if match is not None:
                prefix, piece = match.group(1), match.group(2)
                target = prefix + ("self_attn.qkv_proj" if piece in "qkv" else "mlp.gate_up_proj")
                fused.setdefault(target, {})[piece] = part
            elif name == "embed_tokens.weight":
                self.quantized_embedding = QuantizedWeight((part,))
                del self.embed_tokens
            elif name == "lm_head.weight":
                self.quantized_lm_head = QuantizedWeight((part,))
                del self.lm_head
            elif name is not None and name.endswith(".weight") and name[:-7] in modules:
                modules[name[:-7]].use_quantized(QuantizedWeight((part,)), kernel)
            else:
                raise ValueError(f"unexpected packed weight {hf_name!r}")
        if self.config.tie_word_embeddings:
            self.quantized_lm_head = self.quantized_embedding
        unpacked: list[tuple[str, torch.Tensor]] = []
        for target, parts in fused.items():
            order = ("q", "k", "v") if target.endswith("qkv_proj") else ("gate", "up")
            if all(piece in parts for piece in order):
                stacked = QuantizedWeight.stack([QuantizedWeight((parts[p],)) for p in order])
                modules[target].use_quantized(stacked, kernel)
                continue
            module_name = target.rsplit(".", 1)[0]
            for piece, part in parts.items():
                hf_name = f"model.{module_name}.{piece}_proj.weight"
                unpacked.append((hf_name, kernel.dequantize(part)))
        return unpacked

    def weight_formats(self) -> str:
        """Each layer's projections' formats, runs of alike layers joined, then the embedding's
        and the LM head's, for the start-up log."""

        def format_of(module: Linear) -> str:
            if module.quantized is not None:
                return module.quantized.formats
            weight = module.packed_weight if module.kernel is not None else module.weight
            return str(weight.dtype).removeprefix("torch.")

        runs: list[tuple[int, int, str]] = []
        for index, layer in enumerate(self.layers):
            names = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
            described = ", ".join(
                f"{n.split('.')[1]} {format_of(layer.get_submodule(n))}" for n in names
            )
            if runs and runs[-1][2] == described:
                runs[-1] = (runs[-1][0], index, described)
            else:
                runs.append((index, index, described))
        parts = [f"layers {a}-{b}: {d}" if a != b else f"layer {a}: {d}" for a, b, d in runs]
        embedding = self.quantized_embedding
        head = self.quantized_lm_head
        parts.append(f"embedding {embedding.formats if embedding else 'float'}")
        parts.append(
            f"LM head {head.formats if head else 'float'}"
            + (" (tied)" if self.config.tie_word_embeddings else "")
        )
        return "; ".join(parts)

    def layer_projection_weights(self) -> list[torch.Tensor]:
        """The first layer's float projection weights (what the loader times the packed GEMMs
        on)."""
        layer = self.layers[0]
        projections = [
            layer.self_attn.qkv_proj,
            layer.self_attn.o_proj,
            layer.mlp.gate_up_proj,
            layer.mlp.down_proj,
        ]
        return [m.weight for m in projections if m.quantized is None]

    @property
    def weight_bits(self) -> float | None:
        """Bits a projection or LM-head weight takes on average where some are quantized (the
        performance model's bytes a weight), else None."""
        quantized = [m.quantized for m in self.modules() if isinstance(m, Linear) and m.quantized]
        if self.quantized_lm_head is not None:
            quantized.append(self.quantized_lm_head)
        if not quantized:
            return None
        weights = sum(w.in_features * w.out_features for w in quantized)
        return 8 * sum(w.nbytes for w in quantized) / weights

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (every float weight's)."""
        return self.norm.weight.dtype

    @property
    def local_vocab_size(self) -> int:
        """The LM head's rows on this rank."""
        return self.vocab_range[1] - self.vocab_range[0]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        if self.config.tie_word_embeddings:
            start, end = self.vocab_range
            return self.embed_tokens.weight[start:end]
        return self.lm_head.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.quantized_embedding is not None:
            (part,) = self.quantized_embedding.parts
            ids = input_ids.reshape(-1)
            if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < part.rows:
                raise IndexError(f"token ids must lie in [0, {part.rows})")
            rows = self.quantized_kernel.dequantize(part, ids)
            return rows.to(self.dtype).view(*input_ids.shape, -1)
        return self.embed_tokens(input_ids)

    def run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
        start: int = 0,
        end: int | None = None,
    ) -> torch.Tensor:
        rope = self.rotary(positions, hidden.dtype)
        end = self.config.num_layers if end is None else end
        residual = None
        for index in range(start, end):
            hidden, residual = self.layers[index](hidden, residual, rope, kv_caches[index], meta)
        return hidden if residual is None else (residual + hidden).to(hidden.dtype)

    def logits(
        self, hidden: torch.Tensor, rows: torch.Tensor, out: LogitsBuffer | None = None
    ) -> torch.Tensor:
        """fp32 logits for the selected token rows (the last token of each sampling sequence);
        with `out`, in its memory (valid until its next use)."""
        return self.lm_head_logits(self.norm(hidden.index_select(0, rows)), out)

    def lm_head_local(self, normed: torch.Tensor) -> torch.Tensor:
        """This rank's columns of the logits, in the model's dtype."""
        if self.quantized_lm_head is not None:
            return self.quantized_kernel(normed, self.quantized_lm_head)
        if self.packed_linear is not None:
            return self.packed_linear(normed, self.packed_lm_head, self.local_vocab_size)
        return F.linear(normed, self.lm_head_weight)

    def lm_head_logits(self, normed: torch.Tensor, out: LogitsBuffer | None = None) -> torch.Tensor:
        """fp32 logits of final-normed hidden rows; with `out`, in its memory (with several
        ranks, rank 0's whole rows from every rank's columns, in new memory)."""
        if self.tp.size > 1:
            return self.tp.gather_columns(
                self.lm_head_local(normed).float(), self.config.vocab_size
            )
        if out is None:
            return self.lm_head_local(normed).float()
        # fp32 products are computed straight into the buffer: a new [rows, vocab] fp32 result
        # each step would come from fresh pages (see LogitsBuffer).
        memory = out.memory(normed.shape[0], self.local_vocab_size, normed.device)
        if self.quantized_lm_head is not None:
            return self.quantized_kernel(normed.float(), self.quantized_lm_head, out=memory)
        if self.packed_linear is None and normed.dtype == torch.float32:
            return torch.mm(normed, self.lm_head_weight.t(), out=memory)
        return memory.copy_(self.lm_head_local(normed))

    @torch.inference_mode()
    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face named tensors in, fusing q/k/v and gate/up; fail if any is missing."""
        params = dict(self.named_parameters())
        pending: dict[str, torch.Tensor] = {}
        loaded: set[str] = set()
        c = self.config
        for hf_name, tensor in weights:
            name = _our_name(hf_name)
            if name is None or (name == "lm_head.weight" and c.tie_word_embeddings):
                continue
            match = _FUSED.match(name)
            if match is None:
                if name not in params:
                    raise ValueError(f"unexpected weight {hf_name!r} for a {c.family} model")
                _copy_into(params[name], tensor, hf_name)
                loaded.add(name)
                continue
            prefix, part, suffix = match.group(1), match.group(2), match.group(3)
            fused, order = (
                ("self_attn.qkv_proj", ("q", "k", "v"))
                if part in ("q", "k", "v")
                else ("mlp.gate_up_proj", ("gate", "up"))
            )
            pending[f"{prefix}{part}|{suffix}"] = tensor
            keys = [f"{prefix}{p}|{suffix}" for p in order]
            if all(k in pending for k in keys):
                target = f"{prefix}{fused}.{suffix}"
                _copy_into(params[target], torch.cat([pending.pop(k) for k in keys], 0), target)
                loaded.add(target)
        missing = sorted(set(params) - loaded)
        if pending or missing:
            raise ValueError(f"incomplete weights: missing {(missing or sorted(pending))[:5]}")


_FUSED = re.compile(r"^(layers\.\d+\.)(?:self_attn|mlp)\.(q|k|v|gate|up)_proj\.(weight|bias)$")


def _our_name(hf_name: str) -> str | None:
    if hf_name.startswith("model."):
        return hf_name[len("model.") :]
    if hf_name == "lm_head.weight":
        return hf_name
    if "rotary_emb" in hf_name:
        return None
    return hf_name


def _copy_into(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(
            f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}"
        )
    param.copy_(tensor)

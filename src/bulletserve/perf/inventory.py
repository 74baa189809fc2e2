"""FLOPs and bytes of every op of one step, for a model config and an execution state.

Each op's cost is linear in four counts of its phase, in this order:

- TOKENS: rows through the layers (prefill: new tokens; decode: batch size);
- PAIRS: (query, key) pairs the attention scores (causal prefill with a cached prefix c and n
  new tokens: n*c + n*(n+1)/2; decode at context L: L);
- KV_READ: KV-cache entries read by attention (per sequence: context including new tokens);
- SEQS: sequences, i.e. rows through the final norm, LM head and sampler (only the last
  position of each sequence is sampled).

Conventions (per element): a GEMM costs 2*M*N*K FLOPs and reads its input and weights and
writes its output once; RMSNorm 4 FLOPs; RoPE 3; SiLU-and-multiply 5; softmax sampling 5 per
logit over fp32 logits; attention 4*head_dim FLOPs per pair and head (QK^T and PV), reading
Q and K/V once (flash-style) and writing O and the new K/V entries. Activations and the KV cache
share one dtype of `dtype_bytes` bytes; the GEMMs' weights take that too, or `weight_bytes` a
weight where they are quantized (a packed format's bits, its scales included, over 8). A
quantized GEMM's FLOPs are the same (2 a weight and row): it reads fewer bytes, computes as much.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from bulletserve.model.config import ModelConfig
from bulletserve.perf.execution_state import ExecutionState

TOKENS, PAIRS, KV_READ, SEQS = range(4)
Counts = tuple[float, float, float, float]

# Op scopes: once per layer in the step, once if the step starts at layer 0, once if it ends at
# the last layer.
LAYER, FIRST, LAST = "layer", "first", "last"
LOGIT_BYTES = 4  # the sampler works on fp32 logits

# Bits a weight takes in each packed format (ggml's blocks, their scales included), for
# `bullet simulate --quantization`; the engine passes the bits its loaded weights measure.
WEIGHT_FORMAT_BITS = {
    "q8_0": 8.5,
    "q4_0": 4.5,
    "q4_1": 5.0,
    "q4_k": 4.5,
    "q5_k": 5.5,
    "q6_k": 6.5625,
}


@dataclass(frozen=True)
class OpTemplate:
    """An op's cost as coefficients of the phase counts; `fixed_bytes` are its weights."""

    name: str
    scope: str
    flops: Counts
    bytes: Counts
    fixed_bytes: float = 0.0
    gemm_n: int = 0  # output columns when the op is a GEMM, else 0
    gemm_rows: int = TOKENS  # the count that gives a GEMM's rows


@dataclass(frozen=True)
class Op:
    """One op of a step: per-instance FLOPs and bytes, run `repeat` times (once per layer)."""

    name: str
    flops: float
    bytes: float
    repeat: int
    gemm_m: int = 0
    gemm_n: int = 0


def _per(index: int, value: float) -> Counts:
    out = [0.0, 0.0, 0.0, 0.0]
    out[index] = float(value)
    return (out[0], out[1], out[2], out[3])


def _gemm(
    name: str, scope: str, k: int, n: int, d: int, w: float, bias: bool, rows: int
) -> OpTemplate:
    """`d` bytes an activation, `w` a weight."""
    flops = 2 * k * n + (n if bias else 0)
    weights = k * n * w + (n if bias else 0) * d
    return OpTemplate(
        name, scope, _per(rows, flops), _per(rows, (k + n) * d), weights, gemm_n=n, gemm_rows=rows
    )


@lru_cache(maxsize=64)
def op_templates(
    cfg: ModelConfig, dtype_bytes: int, weight_bytes: float | None = None
) -> tuple[OpTemplate, ...]:
    """The cost templates of every op of a step of `cfg` (cached per config, dtype and weight
    bytes; `weight_bytes` None: the GEMMs' weights in the dtype)."""
    d = dtype_bytes
    w = float(d if weight_bytes is None else weight_bytes)
    h, i, q, kv, v = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size, cfg.vocab_size
    norm = OpTemplate("input_norm", LAYER, _per(TOKENS, 4 * h), _per(TOKENS, 2 * h * d), h * d)
    ops = [
        norm,
        _gemm("qkv_proj", LAYER, h, q + 2 * kv, d, w, cfg.attention_bias, TOKENS),
    ]
    if cfg.qk_norm:
        qk = q + kv
        ops.append(
            OpTemplate(
                "qk_norm",
                LAYER,
                _per(TOKENS, 4 * qk),
                _per(TOKENS, 2 * qk * d),
                2 * cfg.head_dim * d,
            )
        )
    attn_bytes = ((2 * q + 2 * kv) * d, 0.0, 2 * kv * d, 0.0)
    ops += [
        OpTemplate("rope", LAYER, _per(TOKENS, 3 * (q + kv)), _per(TOKENS, 2 * (q + kv) * d)),
        OpTemplate("attention", LAYER, _per(PAIRS, 4 * cfg.head_dim * cfg.num_heads), attn_bytes),
        _gemm("o_proj", LAYER, q, h, d, w, False, TOKENS),
        OpTemplate("residual_add", LAYER, _per(TOKENS, 2 * h), _per(TOKENS, 6 * h * d)),
        OpTemplate("post_norm", LAYER, norm.flops, norm.bytes, norm.fixed_bytes),
        _gemm("gate_up_proj", LAYER, h, 2 * i, d, w, False, TOKENS),
        OpTemplate("act", LAYER, _per(TOKENS, 5 * i), _per(TOKENS, 3 * i * d)),
        _gemm("down_proj", LAYER, i, h, d, w, False, TOKENS),
        OpTemplate("embedding", FIRST, _per(TOKENS, 0), _per(TOKENS, 2 * h * d)),
        OpTemplate("final_norm", LAST, _per(SEQS, 4 * h), _per(SEQS, 2 * h * d), h * d),
        _gemm("lm_head", LAST, h, v, d, w, False, SEQS),
        OpTemplate("sampling", LAST, _per(SEQS, 5 * v), _per(SEQS, v * LOGIT_BYTES)),
    ]
    return tuple(ops)


def prefill_counts(lens: tuple[int, ...], cached: tuple[int, ...]) -> Counts:
    """(tokens, pairs, kv_read, seqs) of a causal prefill of `lens` new tokens on `cached`."""
    cached = cached or (0,) * len(lens)
    pairs = sum(n * c + n * (n + 1) // 2 for n, c in zip(lens, cached, strict=True))
    return (float(sum(lens)), float(pairs), float(sum(lens) + sum(cached)), float(len(lens)))


def decode_counts(ctx: tuple[int, ...], drafts: tuple[int, ...] = ()) -> Counts:
    """(tokens, pairs, kv_read, seqs) of one decode step at contexts `ctx`; with `drafts`,
    row i computes 1 + drafts[i] tokens, each attending to the ones before it and each with its
    logits (the `seqs` count is the LM head's rows), its context read once."""
    total = float(sum(ctx))
    if not drafts:
        return (float(len(ctx)), total, total, float(len(ctx)))
    rows = float(len(ctx) + sum(drafts))
    pairs = sum((d + 1) * c + d * (d + 1) // 2 for c, d in zip(ctx, drafts, strict=True))
    return (rows, float(pairs), total + sum(drafts), rows)


def phase_layers(cfg: ModelConfig, es: ExecutionState, phase: str) -> tuple[int, bool, bool]:
    """(layers run, includes the embedding, includes the LM head) for `phase` of `es`."""
    if phase == "decode" or es.prefill_layers is None:
        return cfg.num_layers, True, True
    first, n = es.prefill_first_layer, es.prefill_layers
    return n, first == 0, first + n >= cfg.num_layers


def phase_counts(es: ExecutionState, phase: str) -> Counts:
    if phase == "prefill":
        return prefill_counts(es.prefill_lens, es.prefill_cached)
    if phase == "decode":
        return decode_counts(es.decode_ctx, es.decode_drafts)
    raise ValueError(f"unknown phase {phase!r}; expected 'prefill' or 'decode'")


def step_ops(
    cfg: ModelConfig,
    es: ExecutionState,
    phase: str,
    dtype_bytes: int,
    weight_bytes: float | None = None,
) -> list[Op]:
    """Every op `phase` runs in step `es`, with FLOPs and bytes per instance."""
    counts = phase_counts(es, phase)
    if counts[TOKENS] == 0:
        return []
    layers, first, last = phase_layers(cfg, es, phase)
    repeat = {LAYER: layers, FIRST: int(first), LAST: int(last)}
    ops = []
    for t in op_templates(cfg, dtype_bytes, weight_bytes):
        if repeat[t.scope] == 0:
            continue
        flops = sum(a * b for a, b in zip(t.flops, counts, strict=True))
        nbytes = t.fixed_bytes + sum(a * b for a, b in zip(t.bytes, counts, strict=True))
        m = int(counts[t.gemm_rows]) if t.gemm_n else 0
        ops.append(Op(t.name, flops, nbytes, repeat[t.scope], m, t.gemm_n))
    return ops

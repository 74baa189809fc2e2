"""A model file is untrusted input: what it must hold before any weight is computed on.

Each failure is one line naming the file, the key or tensor, the value expected and the value
found (`ModelFileError`, a ValueError: `bullet serve` prints it as a CLI error):

- the config's own values (`ModelConfig.check`, run as a config is read): sizes positive and
  within bounds, head counts dividing the width and each other, BOS/EOS/PAD ids inside the
  vocabulary, finite epsilons and RoPE parameters;
- `check_shapes`: every tensor's shape against the config (embedding, LM head tied or not,
  q/k/v/o, MLP, norms, biases), none missing, none unexpected; read from the file's headers
  (or a quantized matrix's rows and columns) before the weights are copied in;
- `check_fits`: the weights at the load dtype within the device's memory;
- a first forward at load (`ModelRunner.check_finite`: a short prompt, each layer's output
  checked for non-finite values), which needs the KV pool.
"""

from __future__ import annotations

from collections.abc import Mapping

from bulletserve.model.config import ModelConfig
from bulletserve.model.file_error import ModelFileError


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the whole (unsharded) model by Hugging Face name, with its shape."""
    c = config
    h, q, kv, i = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, h)
    for layer in range(c.num_layers):
        p = f"model.layers.{layer}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if c.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
        if c.qk_norm:
            shapes |= {
                p + "self_attn.q_norm.weight": (c.head_dim,),
                p + "self_attn.k_norm.weight": (c.head_dim,),
            }
    return shapes


def check_shapes(config: ModelConfig, found: Mapping[str, tuple[int, ...]]) -> None:
    """Every tensor the config asks for is there, in its shape, and nothing else is (an LM head
    beside a tied embedding is allowed and checked; rotary tables are ignored)."""
    expected = expected_shapes(config)
    if config.tie_word_embeddings:
        expected["lm_head.weight"] = (config.vocab_size, config.hidden_size)
    dims = (
        f"vocab_size {config.vocab_size}, hidden_size {config.hidden_size}, "
        f"q {config.q_size}, kv {config.kv_size}, intermediate_size {config.intermediate_size}"
    )
    for name, shape in found.items():
        if "rotary_emb" in name:
            continue
        if name not in expected:
            model = f"{config.family} model of {config.num_layers} layers"
            raise ModelFileError(name, f"only the tensors of a {model}", "this one beside them")
        if tuple(shape) != expected[name]:
            raise ModelFileError(
                name, f"shape {list(expected[name])} ({dims})", f"shape {list(shape)}"
            )
    missing = [n for n in expected if n not in found and n != "lm_head.weight"]
    if not config.tie_word_embeddings and "lm_head.weight" not in found:
        missing.insert(0, "lm_head.weight")
    if missing:
        raise ModelFileError(missing[0], "a tensor of the file", f"none ({len(missing)} missing)")


def check_fits(config: ModelConfig, bytes_per_weight: int, memory_bytes: int, device: str) -> None:
    """The model's weights at `bytes_per_weight` within `memory_bytes` (the device's total)."""
    needed = config.num_parameters() * bytes_per_weight
    if needed > memory_bytes:
        raise ModelFileError(
            "the model's size",
            f"weights within the {device}'s {memory_bytes / 2**30:.1f} GiB",
            f"{config.num_parameters():,} parameters ({needed / 2**30:.1f} GiB)",
        )

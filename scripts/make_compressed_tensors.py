"""Make a compressed-tensors checkpoint with llmcompressor, the ecosystem's own tool (never our
own quantizer), for `bullet serve` and vLLM-CPU to serve side by side.

llmcompressor pins its own transformers, so it runs in a virtual environment of its own:

    python3 -m venv /tmp/lc-venv && /tmp/lc-venv/bin/pip install torch==2.13.0 \
        llmcompressor==0.14.0.1
    /tmp/lc-venv/bin/python scripts/make_compressed_tensors.py /tmp/smollm2-hf /tmp/smol-w8a8
    # the test fixture tests/fixtures/w8a8-tiny-llama (a random 2-layer Llama, vocabulary 512):
    /tmp/lc-venv/bin/python scripts/make_compressed_tensors.py --tiny-random \
        tests/fixtures/w8a8-tiny-llama
    /tmp/lc-venv/bin/python scripts/make_compressed_tensors.py --tiny-random --scheme W8A16 \
        --group-size 32 tests/fixtures/w8a16-g32-tiny-llama    # and W4A16 likewise

Weights are rounded to the nearest step without calibration data (the weight scales come from
the weights, W8A8's activation scales at run time); the LM head stays as it is.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path


def tiny_random_llama(folder: Path, tokenizer_from: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(1)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    for weight in model.parameters():
        if weight.dim() > 1:
            torch.nn.init.normal_(weight, std=0.3)  # peaked logits: clear greedy margins
    model.save_pretrained(folder)
    # llmcompressor loads a tokenizer beside the model; the fixture itself ships without one.
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", nargs="?", type=Path, help="a Hugging Face model folder")
    parser.add_argument("out", type=Path)
    parser.add_argument("--scheme", default="W8A8", help="llmcompressor's preset (W8A8, W8A16)")
    parser.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="the preset's weight groups resized (W8A16's 128 does not divide SmolLM2's 576)",
    )
    parser.add_argument(
        "--tiny-random",
        action="store_true",
        help="quantize a random 2-layer Llama (vocabulary 512) instead of SOURCE",
    )
    parser.add_argument("--tokenizer-from", type=Path, default=Path("/tmp/smollm2-hf"))
    args = parser.parse_args()
    if (args.source is None) != args.tiny_random:
        parser.error("give SOURCE or --tiny-random")

    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import PRESET_SCHEMES
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as scratch:
        source = args.source
        if args.tiny_random:
            source = Path(scratch)
            tiny_random_llama(source, args.tokenizer_from)
        model = AutoModelForCausalLM.from_pretrained(source, torch_dtype="auto")
        if args.group_size is None:
            recipe = QuantizationModifier(targets="Linear", scheme=args.scheme, ignore=["lm_head"])
        else:
            preset = {k: v.model_copy() if v else v for k, v in PRESET_SCHEMES[args.scheme].items()}
            preset["weights"].group_size = args.group_size
            scheme = QuantizationScheme(targets=["Linear"], **preset)
            recipe = QuantizationModifier(config_groups={"group_0": scheme}, ignore=["lm_head"])
        oneshot(model=model, recipe=recipe)
        model.save_pretrained(args.out, save_compressed=True)
        if not args.tiny_random:
            AutoTokenizer.from_pretrained(source).save_pretrained(args.out)
    print(f"{args.scheme} checkpoint in {args.out}")


if __name__ == "__main__":
    main()

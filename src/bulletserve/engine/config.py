"""Engine settings and their command-line flags (vLLM's names where the meaning is the same);
the scheduler's part is sched/config.py's `SchedulerConfig`, the model's shape model/config.py's."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, fields
from pathlib import Path

from bulletserve.engine.grammar_limits import (
    DEFAULT_COMPILE_TIMEOUT_S,
    DEFAULT_COMPILE_WORKERS,
    DEFAULT_GRAMMAR_CACHE_MB,
    DEFAULT_MAX_GRAMMAR_BYTES,
    GrammarLimits,
)
from bulletserve.model.source import LOAD_FORMATS, check_quantization
from bulletserve.sched import POLICIES, SLO, SchedulerConfig
from bulletserve.sched.base import SCHEDULING_POLICIES
from bulletserve.sched.slo import check_target
from bulletserve.spec.config import SpeculativeConfig

# How long the engine waits, after a step's outputs went to the server's event loop, for the
# loop to have written them out before it computes the next step (`AsyncEngine._deliver`,
# and the lanes before planning theirs). Only on a CPU: there the loop's thread would take a
# core from the compute team; a GPU's step shares nothing with the loop but the interpreter
# lock, and a wait would leave the device idle while the loop writes.
HANDOFF_WAIT_S = 0.05


def waits_for_handoff(device_type: str) -> bool:
    """Whether a served engine on this kind of device waits for the event loop's hand-off."""
    return device_type == "cpu"


@dataclass(frozen=True, kw_only=True)
class EngineConfig(SchedulerConfig):
    """The scheduler's settings (`SchedulerConfig`, shared with the simulator) and what the
    engine runs them on."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct
    revision: str | None = None  # of a Hugging Face id's snapshot in the local cache
    load_format: str = "auto"
    quantization: str | None = None  # detected from the checkpoint when None (model/loader.py)
    tokenizer: str | None = None  # a tokenizer or model folder; default: the model's own
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None  # default: the model's context length
    kv_cache_memory: str | None = None  # bytes or a fraction of free memory
    gpu_memory_utilization: float | None = None  # on a GPU: vLLM's, in place of the above
    num_threads: int | None = None  # CPU intra-op threads (a rank's); default: its share of cores
    tensor_parallel_size: int = 1  # ranks the weights and KV heads are sharded over
    enforce_eager: bool = False  # on CUDA, run decode steps eagerly, not as CUDA graphs
    # Plan and launch each step while the last one runs (engine/single_lane.py); one lane only.
    async_scheduling: bool = False
    # Speculative decoding (vLLM's --speculative-config: a JSON object, a dict, or parsed).
    speculative_config: SpeculativeConfig | None = None
    # LoRA adapters (vLLM's --enable-lora, --lora-modules name=path, --max-lora-rank).
    enable_lora: bool = False
    lora_modules: tuple[str, ...] = ()
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # adapters kept in memory (None: every one served)
    max_loras: int | None = None  # adapters running requests use together (None: any number)
    lora_dtype: str = "auto"  # the adapters' weights: auto (the model's dtype) or a dtype
    cpu_warmup_rows: int = 256  # build the CPU GEMM kernels of steps up to this many rows at start
    # The SLO the bullet policy schedules for (and /metrics counts attainment against).
    slo_ttft_per_token_ms: float = 3.0
    slo_ttft_base_ms: float = 0.0  # a fixed part of the TTFT SLO, beside the per-token part
    slo_tpot_ms: float = 150.0
    # Sampling defaults: auto (the model's generation_config.json), vllm (ours), or a folder.
    generation_config: str = "auto"
    hardware_profile: str | None = None  # a `bullet profile` JSON; default: measured at start
    # Structured outputs' bounds (engine/grammar_limits.py).
    max_grammar_bytes: int = DEFAULT_MAX_GRAMMAR_BYTES
    grammar_compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S
    grammar_cache_mb: int = DEFAULT_GRAMMAR_CACHE_MB
    grammar_compile_workers: int = DEFAULT_COMPILE_WORKERS
    step_log: str | None = None  # a JSON line per lane step

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("max_model_len", "num_threads", "tensor_parallel_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        for name in ("ttft_per_token_ms", "tpot_ms", "ttft_base_ms"):
            check_target(name, getattr(self, f"slo_{name}"), f"--slo-{name.replace('_', '-')}")
        if self.cpu_warmup_rows < 0:
            raise ValueError(f"--cpu-warmup-rows must be >= 0, got {self.cpu_warmup_rows}")
        self.grammar_limits  # noqa: B018 - raises ValueError naming the flag out of range
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"--load-format must be one of {', '.join(LOAD_FORMATS)}")
        check_quantization(self.quantization)
        if self.tokenizer is not None and not Path(self.tokenizer).expanduser().exists():
            raise ValueError(f"--tokenizer {self.tokenizer!r} does not exist")
        if (
            self.generation_config not in ("auto", "vllm")
            and not (Path(self.generation_config).expanduser() / "generation_config.json").is_file()
        ):
            raise ValueError(
                f"--generation-config {self.generation_config!r}: auto, vllm, or a folder with "
                "a generation_config.json"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"--device must be auto, cpu or cuda, not {self.device!r}")
        if self.async_scheduling and self.policy == "bullet":
            raise ValueError(
                "--async-scheduling runs the one-lane policies (chunked, prefill-first); "
                "Bullet's two lanes do not overlap their steps with the host's planning yet"
            )
        if self.speculative_config is not None:
            spec = SpeculativeConfig.parse(self.speculative_config)
            object.__setattr__(self, "speculative_config", spec)
            if spec.method == "draft_model" and self.tensor_parallel_size > 1:
                raise ValueError(
                    "--speculative-config draft_model with --tensor-parallel-size > 1 is not "
                    "built yet: the draft model runs on one rank"
                )
            if self.async_scheduling:
                raise ValueError(
                    "--speculative-config with --async-scheduling is not built yet: a step's "
                    "accepted tokens decide the next step's rows, so the next is not planned "
                    "before this one is read back"
                )
        if self.lora_modules and not self.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        if self.enable_lora:
            object.__setattr__(self, "lora_modules", tuple(self.lora_modules))
            for module in self.lora_modules:
                lora_module(module)
            if self.max_lora_rank < 1:
                raise ValueError(f"--max-lora-rank must be >= 1, not {self.max_lora_rank}")
            if self.max_cpu_loras is not None and self.max_cpu_loras < 1:
                raise ValueError(f"--max-cpu-loras must be >= 1, not {self.max_cpu_loras}")
            if self.max_loras is not None and self.max_loras < 1:
                raise ValueError(f"--max-loras must be >= 1, not {self.max_loras}")
        elif self.max_loras is not None:
            raise ValueError("--max-loras needs --enable-lora")
            if self.tensor_parallel_size > 1:
                raise ValueError(
                    "--enable-lora with --tensor-parallel-size > 1 is not built yet: the "
                    "adapters' A or B are not sharded over the ranks"
                )
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise ValueError(
                "--async-scheduling is not built for --tensor-parallel-size > 1: the other "
                "ranks are sent each step's tokens, and a step's tokens are not on the host yet"
            )

    @property
    def grammar_limits(self) -> GrammarLimits:
        return GrammarLimits(
            self.max_grammar_bytes,
            self.grammar_compile_timeout,
            self.grammar_cache_mb * 1024 * 1024,
            self.grammar_compile_workers,
        )

    @property
    def slo(self) -> SLO:
        return SLO(self.slo_ttft_per_token_ms, self.slo_tpot_ms, self.slo_ttft_base_ms)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        values = {f.name: getattr(args, f.name) for f in fields(cls)}
        return cls(**values | {"policy": policy_of(args)})


def lora_module(value: str) -> tuple[str, str]:
    """(name, path) of a --lora-modules entry: `name=path`, or vLLM's JSON form
    `{"name": ..., "path": ..., "base_model_name": ...}`; ValueError naming what is wrong."""
    if value.lstrip().startswith("{"):
        try:
            entry = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--lora-modules {value!r}: not JSON: {exc}") from None
        name, path = entry.get("name"), entry.get("path")
        unknown = sorted(set(entry) - {"name", "path", "base_model_name"})
        if unknown:
            raise ValueError(f"--lora-modules {value!r}: unknown key {unknown[0]!r}")
    else:
        name, _, path = value.partition("=")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise ValueError(f"--lora-modules takes name=path or a JSON object, not {value!r}")
    return name, path


def policy_of(args: argparse.Namespace) -> str:
    """--policy, as vLLM's --enable-chunked-prefill / --no-enable-chunked-prefill sets it:
    off runs each prompt whole before decoding (prefill-first)."""
    chunked = args.enable_chunked_prefill
    if chunked is None or (chunked and args.policy != "prefill-first"):
        return args.policy
    if chunked:
        raise ValueError("--enable-chunked-prefill contradicts --policy prefill-first")
    if args.policy == "bullet":
        raise ValueError(
            "--no-enable-chunked-prefill: the bullet policy rides long prompts in chunks beside "
            "decode; use --policy prefill-first for whole prompts"
        )
    return "prefill-first"


def add_scheduler_args(
    parser: argparse.ArgumentParser, group: argparse._ArgumentGroup
) -> argparse._ArgumentGroup:
    """The flags of `SchedulerConfig`, as `bullet serve` and `bullet simulate` both take them,
    with its defaults; returns the group of Bullet's own flags."""
    default = {f.name: f.default for f in fields(SchedulerConfig)}
    group.add_argument("--policy", default=default["policy"], choices=POLICIES)
    group.add_argument(
        "--scheduling-policy",
        default=default["scheduling_policy"],
        choices=SCHEDULING_POLICIES,
        help="vLLM's: fcfs, or priority (a request's `priority` field, lower first, orders the "
        "queue, and the lowest-priority running request is preempted first)",
    )
    group.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="vLLM's: on is --policy chunked (ours by default), off is --policy prefill-first "
        "(default: as --policy says)",
    )
    group.add_argument("--max-num-seqs", type=int, default=default["max_num_seqs"])
    group.add_argument(
        "--max-num-batched-tokens", type=int, default=default["max_num_batched_tokens"]
    )
    group.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="the longest prompt chunk of a step (default: --max-num-batched-tokens)",
    )
    group.add_argument("--block-size", type=int, default=default["block_size"])
    group.add_argument(
        "--max-queue-delay-ms",
        type=float,
        default=None,
        help="shed a request still waiting for its first step after this long: its HTTP "
        "answer is a 429 (an error event where it streams), so that load past capacity drops "
        "the requests that would miss their SLO anyway (default: none shed)",
    )
    group.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=default["enable_prefix_caching"],
        help="reuse the KV of prompt prefixes already computed, in full blocks, across requests "
        "and both lanes (--no-enable-prefix-caching turns it off)",
    )
    bullet = parser.add_argument_group("bullet (--policy bullet)")
    bullet.add_argument(
        "--partition",
        default=default["partition"],
        help="auto (the scheduler splits units per step), none (both lanes on every unit), "
        "or static:P/D (P units for prefill, D for decode)",
    )
    bullet.add_argument(
        "--prefill-layers-per-step",
        type=int,
        default=None,
        help="run a prefill in groups of N layers so the split can change inside it",
    )
    bullet.add_argument(
        "--fuse-decode",
        action=argparse.BooleanOptionalAction,
        default=default["fuse_decode"],
        help="let a prefill step carry the decode rows in its own batch where the performance "
        "model says that does more work a second than taking turns or sharing the device "
        "(on a GPU, only a step that fits in the TPOT budget)",
    )
    return bullet


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Every EngineConfig field's flag, with the field's default."""
    default = {f.name: f.default for f in fields(EngineConfig)}
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=None,
        help="a Hugging Face id found in the local Hugging Face cache (ORG/NAME), an HF "
        "folder, a .gguf file, or a dummy preset (default: embedded SmolLM2-135M-Instruct)",
    )
    group.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="accepted as vLLM's command lines give it: the models here run on bulletserve's "
        "own implementation of their architecture, never on code from their repository, so "
        "nothing is trusted and the flag changes nothing",
    )
    group.add_argument(
        "--quantization",
        "-q",
        default=None,
        help="how the weights are stored and run; default: detected from the checkpoint. gguf: "
        "a GGUF file's Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K blocks kept packed and read by our "
        "CPU kernel (other types dequantized at load); compressed-tensors: a checkpoint's int8 or "
        "int4 weights with a scale per channel or group (llmcompressor's W8A8, W8A16, W4A16) "
        "kept packed for the same kernel; none: every weight dequantized to --dtype. awq, gptq, "
        "fp8 and int8 are refused until built",
    )
    group.add_argument(
        "--revision",
        default=None,
        help="the snapshot of a Hugging Face id to use (a branch, tag or commit; default: main)",
    )
    group.add_argument(
        "--load-format",
        default=default["load_format"],
        choices=LOAD_FORMATS,
        help="dummy: random weights, of a preset's shape (tiny, smollm2-135m, llama-3.1-8b, ...) "
        "or of the --model folder's or cached id's config.json",
    )
    group.add_argument(
        "--tokenizer",
        default=None,
        help="a tokenizer (or model) folder or .gguf file to use instead of the model's own "
        "(dummy presets default to the embedded model's tokenizer)",
    )
    group.add_argument(
        "--dtype",
        default=default["dtype"],
        help="auto (bf16 on a GPU and on a CPU with native bf16, else float32), "
        "bfloat16, float16 or float32",
    )
    group.add_argument("--device", default=default["device"], choices=("auto", "cpu", "cuda"))
    group.add_argument(
        "--generation-config",
        default=default["generation_config"],
        help="sampling defaults for requests that leave them out (temperature, top_p, top_k, "
        "min_p, repetition_penalty, max_tokens): auto, from the model's "
        "generation_config.json where it has one; vllm, ours; or a folder holding one",
    )
    group.add_argument("--seed", type=int, default=default["seed"])
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument(
        "--kv-cache-memory",
        default=None,
        help="the KV cache's memory: bytes (e.g. 4GiB) or a fraction of free memory (default: 0.3)",
    )
    group.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="on a GPU, as vLLM's: the share of the device's memory the engine may hold; the "
        "KV cache gets what the weights leave of it (instead of --kv-cache-memory; a CPU "
        "takes --kv-cache-memory)",
    )
    group.add_argument(
        "--num-threads",
        type=int,
        default=None,
        help="CPU threads of each rank (default: all usable cores, shared out among the ranks)",
    )
    group.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=default["tensor_parallel_size"],
        help="shard the weights and the KV cache's heads over N ranks (processes on this "
        "machine, a GPU each, or sharing the CPU's cores), torch.distributed between them "
        "(NCCL on GPUs, gloo on CPUs)",
    )
    group.add_argument(
        "--cpu-warmup-rows",
        type=int,
        default=default["cpu_warmup_rows"],
        help="on a CPU in bf16 or fp16, build the GEMM kernels of steps of up to N rows "
        "(above 32 rows padded to multiples of 16) at start, at every thread count a lane may "
        "use, so that no request pays for building one (0: build each when first met)",
    )
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run decode steps eagerly; by default they replay as CUDA graphs, one per "
        "batch bucket and SM group",
    )
    group.add_argument(
        "--async-scheduling",
        action="store_true",
        help="plan and launch each step while the last one still runs on the device, its "
        "tokens read back after (vLLM's flag; --policy chunked or prefill-first). On a GPU the "
        "host's work between steps hides behind the device's; a CPU computes as it launches, "
        "so there it overlaps nothing",
    )
    group.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding, as vLLM\'s JSON: {"method": "ngram", '
        '"num_speculative_tokens": K, "prompt_lookup_min": N, "prompt_lookup_max": M} drafts '
        "up to K tokens a step where the last N..M tokens occurred before in the prompt or "
        "output; the model verifies them in one step and its output is the same as without",
    )
    lora = parser.add_argument_group("LoRA adapters")
    lora.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters (PEFT folders) over the base model: a request's `model` "
        "names its adapter",
    )
    lora.add_argument(
        "--lora-modules",
        nargs="+",
        default=(),
        metavar="NAME=PATH",
        help='the adapters served from the start: name=path, or vLLM\'s JSON {"name": ..., '
        '"path": ..., "base_model_name": ...}',
    )
    lora.add_argument(
        "--max-lora-rank",
        type=int,
        default=16,
        help="the highest adapter rank served (vLLM's default 16); a higher one is refused at load",
    )
    lora.add_argument(
        "--max-loras",
        type=int,
        default=None,
        help="the most adapters the running requests use together: a request of another "
        "adapter waits, and the queue is not overtaken (default: any number; vLLM's is 1, for "
        "its adapter slots in GPU memory)",
    )
    lora.add_argument(
        "--max-cpu-loras",
        type=int,
        default=None,
        help="the adapters kept in memory, the least recently used read again from its folder "
        "when next asked for (default: every adapter served)",
    )
    lora.add_argument(
        "--lora-dtype",
        default="auto",
        help="the adapters' weights: auto (the model's dtype), float32, bfloat16 or float16",
    )
    grammar = parser.add_argument_group("structured outputs")
    grammar.add_argument(
        "--max-grammar-bytes",
        type=int,
        default=default["max_grammar_bytes"],
        help="the largest JSON schema, regex, EBNF grammar or choice list a request may send "
        "(bytes; larger is a 400 before anything is compiled)",
    )
    grammar.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=default["grammar_compile_timeout"],
        help="seconds one grammar may take to compile, from when a compiler process takes it "
        "up; past them the compile is stopped and the request gets a 400",
    )
    grammar.add_argument(
        "--grammar-cache-mb",
        type=int,
        default=default["grammar_cache_mb"],
        help="memory kept for compiled grammars, reused by requests that ask the same (MiB)",
    )
    grammar.add_argument(
        "--grammar-compile-workers",
        type=int,
        default=default["grammar_compile_workers"],
        help="grammar compiler processes (each compiles one grammar at a time, at a lower CPU "
        "priority than serving)",
    )
    bullet = add_scheduler_args(parser, group)
    bullet.add_argument(
        "--slo-ttft-per-token-ms", type=float, default=default["slo_ttft_per_token_ms"]
    )
    bullet.add_argument(
        "--slo-ttft-base-ms",
        type=float,
        default=default["slo_ttft_base_ms"],
        help="a fixed part of the TTFT SLO: a prompt of n tokens has base + n x per-token",
    )
    bullet.add_argument("--slo-tpot-ms", type=float, default=default["slo_tpot_ms"])
    bullet.add_argument("--hardware-profile", default=None, help="a `bullet profile` JSON file")
    bullet.add_argument(
        "--step-log", default=None, help="write one JSON line per step (per lane step under bullet)"
    )

"""Our C kernels for the CPU, compiled on first use and called through ctypes.

- `csrc/decode_attention.c`: decode attention reading the paged KV cache in place. PyTorch has
  no paged attention for the CPU: its path gathers every sequence's keys and values into a
  padded tensor each layer and runs the generic SDPA kernel.
- `csrc/cpu_ops.c`: the element-wise chains of a layer fused (residual add + RMSNorm, RoPE in
  place, SiLU * up), each one pass over the activations instead of five to ten PyTorch ops.
- `csrc/prefill_attention.c`: prefill attention (whole prompts and later chunks after cached
  ones) reading the paged cache in place, flash-style; bf16 on AMX tiles where the CPU has
  them (a head dimension of a multiple of 64), AVX-512 bf16 or fp32 vectors elsewhere.
- `csrc/blocked_linear.c`: an fp32 GEMM over weights packed at load in blocks of 16 columns.
- `csrc/sampling.c`: the sampler's draw (or argmax) of fp32 logit rows at a temperature without
  top-k or top-p, in two passes over each row where PyTorch's ops take five.
- `PackedLinearKernel` is no C of ours: the projections through oneDNN with weights reordered
  once at load. The loader times it and the blocked GEMM against PyTorch's own GEMM at a decode
  step's rows and a prefill's, and keeps the fastest (`packed_linear_kernel`).

They are compiled with the system C compiler for this machine (`-march=native`) and cached under
the bulletserve cache folder; the attention kernel per head shape, so that its loops unroll.
Where no compiler is found, the compile fails, or the case does not fit (a dtype other than
bf16/fp32, head_dim not a multiple of 16, a non-CPU device), the getters return None, a warning
says why, and the model runs its PyTorch path. `BULLET_CPU_KERNELS=0` forces the PyTorch path.
The kernels release the GIL (ctypes does) and use as many OpenMP threads as
`torch.get_num_threads()` gives the calling thread, so each lane keeps its own share of cores.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import platformdirs
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
LANES = 16
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
_SUFFIX = {torch.bfloat16: "bf16", torch.float32: "f32"}
_lock = threading.Lock()
_libraries: dict[tuple[str, tuple[str, ...]], ctypes.CDLL | None] = {}

_ptr, _int, _long, _float = ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_float


def kernels_enabled(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cpu" and dtype in _SUFFIX and os.environ.get("BULLET_CPU_KERNELS") != "0"


def _cpu_key() -> str:
    """What `-march=native` depends on: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return os.uname().machine
    wanted = [line for line in lines if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(wanted)))


def _compile(source: Path, defines: tuple[str, ...]) -> Path:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise RuntimeError("no C compiler (gcc or cc) on PATH")
    key = hashlib.sha256(
        "|".join([source.read_text(), compiler, *_FLAGS, *defines, _cpu_key()]).encode()
    ).hexdigest()[:16]
    root = Path(os.environ.get("BULLET_CACHE_DIR") or platformdirs.user_cache_dir("bulletserve"))
    library = root / "kernels" / f"{source.stem}-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        built = Path(tmp) / library.name
        obj = Path(tmp) / f"{source.stem}.o"
        # Compiled with -ffast-math (vector expf, reassociated sums) but linked without it:
        # GCC links -ffast-math shared objects with crtfastmath.o, whose constructor turns on
        # flush-to-zero for the whole process, changing every later float computation.
        steps = [
            [compiler, *_FLAGS, *defines, "-c", str(source), "-o", str(obj)],
            [compiler, "-shared", "-fopenmp", str(obj), "-o", str(built), "-lm"],
        ]
        for command in steps:
            result = subprocess.run(command, capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[:2000]}")
        os.replace(built, library)  # atomic: a concurrent process may have done the same
    return library


def _library(name: str, defines: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    key = (name, defines)
    with _lock:
        if key not in _libraries:
            try:
                _libraries[key] = ctypes.CDLL(str(_compile(CSRC / f"{name}.c", defines)))
            except (OSError, RuntimeError, subprocess.TimeoutExpired) as exc:
                log.warning("CPU kernels %s unavailable, using PyTorch ops: %s", name, exc)
                _libraries[key] = None
        return _libraries[key]


def _function(
    library: ctypes.CDLL, name: str, argtypes: list, restype: type | None = None
) -> ctypes._CFuncPtr:
    function = getattr(library, name)
    function.argtypes = argtypes
    function.restype = restype
    return function


@dataclass(frozen=True)
class DecodeAttentionKernel:
    """Decode attention for one (dtype, head_dim, group) shape."""

    label: ClassVar[str] = "ours (C), paged in place"

    function: ctypes._CFuncPtr

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Writes into `out` ([B, H, D], contiguous) the attention of q ([B, H, D]) over each
        sequence's `context_lens` tokens; caches: [slots, KVH, D] with slot = block *
        block_size + offset; block_tables: int32 [B, max_blocks]; context_lens: int32 [B]."""
        q = q.contiguous()
        for name, tensor in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
            if tensor.dtype != q.dtype or not tensor.is_contiguous():
                raise ValueError(f"{name} must be contiguous {q.dtype}, got {tensor.dtype}")
        if out.shape != q.shape:
            raise ValueError(f"out {tuple(out.shape)} does not match q {tuple(q.shape)}")
        batch, num_heads, head_dim = q.shape
        failed = self.function(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            out.data_ptr(),
            batch,
            num_heads,
            k_cache.shape[1],
            head_dim,
            block_size,
            block_tables.shape[1],
            scale,
            torch.get_num_threads(),
        )
        if failed:
            raise RuntimeError(f"decode attention kernel failed (code {failed})")


def decode_attention_kernel(
    dtype: torch.dtype, head_dim: int, group: int, device: torch.device
) -> DecodeAttentionKernel | None:
    """The compiled kernel for this shape, or None where it cannot be used."""
    if not kernels_enabled(dtype, device) or head_dim % LANES:
        return None
    library = _library("decode_attention", (f"-DHEAD_DIM={head_dim}", f"-DGROUP={group}"))
    if library is None:
        return None
    argtypes = [_ptr] * 6 + [_int] * 6 + [_float, _int]
    name = f"decode_attention_{_SUFFIX[dtype]}"
    return DecodeAttentionKernel(_function(library, name, argtypes, ctypes.c_int))


@dataclass(frozen=True)
class PrefillAttentionKernel:
    """Causal attention of prefill rows over their sequences' cached and new keys, for one
    (dtype, head_dim, group) shape."""

    label: ClassVar[str] = "ours (C), paged in place"

    function: ctypes._CFuncPtr
    # bf16 runs on AMX tiles (compiled for a CPU with AMX, and the OS lends the tiles)
    on_amx: bool = False

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        spans: torch.Tensor,
        block_size: int,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Writes into `out` ([T', H, D], contiguous, T' >= T) the attention of q ([T, H, D]
        with unit head and element strides: a column slice of the fused projection is fine).
        caches: [slots, KVH, D], the new keys and values already written; block_tables: int32
        [S, max_blocks]; spans: int32 [3, S], each sequence's first query row, query length and
        cached length."""
        tokens, num_heads, head_dim = q.shape
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            raise ValueError("q must have unit element stride and head stride head_dim")
        for name, tensor in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
            if tensor.dtype != q.dtype or not tensor.is_contiguous():
                raise ValueError(f"{name} must be contiguous {q.dtype}, got {tensor.dtype}")
        if out.shape[0] < tokens or out.shape[1:] != q.shape[1:]:
            raise ValueError(f"out {tuple(out.shape)} cannot hold q {tuple(q.shape)}")
        if spans.dtype != torch.int32 or not spans.is_contiguous() or spans.shape[0] != 3:
            raise ValueError("spans must be contiguous int32 [3, num_seqs]")
        if block_tables.dtype != torch.int32 or not block_tables.is_contiguous():
            raise ValueError("block_tables must be contiguous int32")
        failed = self.function(
            q.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            block_tables.data_ptr(),
            spans[0].data_ptr(),
            spans[1].data_ptr(),
            spans[2].data_ptr(),
            out.data_ptr(),
            q.stride(0),
            spans.shape[1],
            num_heads,
            k_cache.shape[1],
            head_dim,
            block_size,
            block_tables.shape[1],
            scale,
            torch.get_num_threads(),
        )
        if failed:
            raise RuntimeError(f"prefill attention kernel failed (code {failed})")


def prefill_attention_kernel(
    dtype: torch.dtype, head_dim: int, group: int, device: torch.device
) -> PrefillAttentionKernel | None:
    """The compiled kernel for this shape, or None where it cannot be used."""
    if not kernels_enabled(dtype, device) or head_dim % LANES:
        return None
    library = _library("prefill_attention", (f"-DHEAD_DIM={head_dim}", f"-DGROUP={group}"))
    if library is None:
        return None
    argtypes = [_ptr] * 8 + [_long] + [_int] * 6 + [_float, _int]
    name = f"prefill_attention_{_SUFFIX[dtype]}"
    on_amx = dtype == torch.bfloat16 and bool(
        _function(library, "prefill_attention_bf16_on_amx", [], ctypes.c_int)()
    )
    return PrefillAttentionKernel(_function(library, name, argtypes, ctypes.c_int), on_amx)


# oneDNN picks a weight layout for a row count; the projections' timings hardly differ between
# layouts chosen for 1, 64 or 512 rows, at any of those row counts.
PACK_ROWS_HINT = 64


class LinearKernel(Protocol):
    """A CPU GEMM y = x W^T (+ bias) over weights repacked once, at load, into its own layout."""

    # Whether it builds (JIT-compiles) a kernel per new row count, as oneDNN does: the runner
    # then pads rows and warms those builds up (engine.model_runner.builds_gemm_kernels).
    builds_per_row_count: ClassVar[bool]

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """[out, in] -> the layout `__call__` reads (the same values)."""
        ...

    def __call__(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [..., in] in the weight's dtype; returns [..., out_features]."""
        ...


@dataclass(frozen=True)
class PackedLinearKernel:
    """The GEMM through oneDNN, with W reordered into the blocked layout its GEMM reads. PyTorch's
    own CPU linear reorders (bf16: oneDNN) or reads W as it is (fp32: MKL) at every call: on two
    Zen 5 cores the packed form ran a decode step's projections 1.3-1.8x faster in bf16 and
    2-3x in fp32, a prefill's about 1.05x and 2x."""

    label: ClassVar[str] = "oneDNN, weights prepacked"

    builds_per_row_count: ClassVar[bool] = True

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """[out, in] -> an opaque oneDNN tensor for `__call__` (the same values)."""
        if weight.dim() != 2:
            raise ValueError(f"weight must be [out, in], got {tuple(weight.shape)}")
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)

    def __call__(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: [..., in] in the weight's dtype; returns [..., out_features]."""
        if x.dtype != packed.dtype or x.shape[-1] != packed.shape[1]:
            raise ValueError(
                f"x must be {packed.dtype} [..., {packed.shape[1]}], got {x.dtype} {x.shape}"
            )
        if packed.shape[0] != out_features:
            raise ValueError(f"packed weight {tuple(packed.shape)} does not hold {out_features}")
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


BLOCK_COLS = 16  # output columns per block of csrc/blocked_linear.c's layout


@dataclass(frozen=True)
class BlockedLinearKernel:
    """The fp32 GEMM of csrc/blocked_linear.c, with W in blocks of 16 output columns."""

    label: ClassVar[str] = "ours (C), fp32 in blocks of 16 columns"

    function: ctypes._CFuncPtr
    builds_per_row_count: ClassVar[bool] = False

    @staticmethod
    def pack(weight: torch.Tensor) -> torch.Tensor:
        """[out, in] -> [ceil(out / 16), in, 16]: for each block of 16 output columns, their
        weights k by k (zero past `out`)."""
        if weight.dim() != 2 or weight.dtype != torch.float32:
            raise ValueError(f"weight must be fp32 [out, in], got {weight.dtype} {weight.shape}")
        out, width = weight.shape
        blocks = -(-out // BLOCK_COLS)
        padded = F.pad(weight, (0, 0, 0, blocks * BLOCK_COLS - out))
        return padded.view(blocks, BLOCK_COLS, width).transpose(1, 2).contiguous()

    def __call__(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        out_features: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x: fp32 [..., in]; packed: `pack`'s [ceil(out_features / 16), in, 16]."""
        width = packed.shape[1]
        if x.dtype != torch.float32 or x.shape[-1] != width:
            raise ValueError(f"x must be fp32 [..., {width}], got {x.dtype} {x.shape}")
        if packed.shape != (-(-out_features // BLOCK_COLS), width, BLOCK_COLS):
            raise ValueError(f"packed weight {packed.shape} does not hold {out_features} outputs")
        rows_in = x.reshape(-1, width).contiguous()
        out = torch.empty((rows_in.shape[0], out_features), dtype=torch.float32)
        bias = None if bias is None else bias.contiguous()  # held until the call returns
        self.function(
            rows_in.data_ptr(),
            packed.data_ptr(),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            rows_in.shape[0],
            width,
            out_features,
            torch.get_num_threads(),
        )
        return out.view(*x.shape[:-1], out_features)


def onednn_linear_kernel(dtype: torch.dtype, device: torch.device) -> PackedLinearKernel | None:
    """oneDNN's packed GEMM where it can run this dtype here, else None."""
    usable = kernels_enabled(dtype, device) and torch.backends.mkldnn.is_available()
    # oneDNN reorders bf16 weights only where the CPU has AVX-512 (or AVX-NE-CONVERT).
    if not usable or (dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return None
    return PackedLinearKernel()


def blocked_linear_kernel(dtype: torch.dtype, device: torch.device) -> BlockedLinearKernel | None:
    """Our fp32 blocked GEMM where it compiles, else None."""
    if dtype != torch.float32 or not kernels_enabled(dtype, device):
        return None
    library = _library("blocked_linear")
    if library is None:
        return None
    return BlockedLinearKernel(
        _function(library, "blocked_linear_f32", [_ptr] * 4 + [_long] * 3 + [_int])
    )


# The loader times each packed GEMM against PyTorch's at a decode step's rows and at a
# prefill's. Packing is one-way (the [out, in] copy is freed, so the chosen kernel then runs
# every projection): a kernel is eligible where it is faster at decode rows and at most 10%
# slower at prefill rows (where all run near the cores' peak; decode steps are the many), and
# of the eligible ones the lowest sum of the two times relative to PyTorch's wins.
DECODE_ROWS, PREFILL_ROWS = 8, 256
PREFILL_SLOWDOWN_ALLOWED = 1.1


def packed_linear_kernel(
    dtype: torch.dtype, device: torch.device, weights: list[torch.Tensor] | None = None
) -> LinearKernel | None:
    """A packed GEMM where one can be used, else None: oneDNN's, else our blocked one. Given
    `weights` (one layer's projections), the one that runs them fastest on this machine,
    and only where it beats PyTorch's GEMM as the rule above says (timed alternately with
    `F.linear` on the calling thread)."""
    candidates: list[LinearKernel] = [
        kernel
        for kernel in (onednn_linear_kernel(dtype, device), blocked_linear_kernel(dtype, device))
        if kernel is not None
    ]
    if not candidates or weights is None:
        return candidates[0] if candidates else None
    (decode, decode_base), (prefill, prefill_base) = (
        _time_linears(candidates, weights, rows) for rows in (DECODE_ROWS, PREFILL_ROWS)
    )
    best, best_cost = None, float("inf")
    for kernel, at_decode, at_prefill in zip(candidates, decode, prefill, strict=True):
        eligible = at_decode < decode_base and at_prefill <= PREFILL_SLOWDOWN_ALLOWED * prefill_base
        cost = at_decode / decode_base + at_prefill / prefill_base
        if eligible and cost < best_cost:
            best, best_cost = kernel, cost
    log.info(
        "packed GEMMs vs PyTorch's on one layer's projections (%d, %d rows): %s, PyTorch "
        "%.2f, %.2f ms; using %s",
        DECODE_ROWS,
        PREFILL_ROWS,
        ", ".join(
            f"{type(k).__name__} {d * 1e3:.2f}, {p * 1e3:.2f} ms"
            for k, d, p in zip(candidates, decode, prefill, strict=True)
        ),
        decode_base * 1e3,
        prefill_base * 1e3,
        "PyTorch's" if best is None else type(best).__name__,
    )
    return best


def _time_linears(
    kernels: list[LinearKernel], weights: list[torch.Tensor], rows: int, repeats: int = 5
) -> tuple[list[float], float]:
    """Median seconds of one pass over `weights` at `rows` rows: (each kernel's, PyTorch's)."""
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(rows, w.shape[1], generator=generator).to(w.dtype) for w in weights]
    packed = [[(kernel.pack(w), w.shape[0]) for w in weights] for kernel in kernels]
    times: list[list[float]] = [[] for _ in range(len(kernels) + 1)]
    for _ in range(repeats + 1):  # the first round warms caches and thread teams up
        for kernel, kernel_packed, kernel_times in zip(kernels, packed, times, strict=False):
            start = time.perf_counter()
            for x, (p, out) in zip(inputs, kernel_packed, strict=True):
                kernel(x, p, out)
            kernel_times.append(time.perf_counter() - start)
        start = time.perf_counter()
        for x, weight in zip(inputs, weights, strict=True):
            F.linear(x, weight)
        times[-1].append(time.perf_counter() - start)
    medians = [statistics.median(t[1:]) for t in times]
    return medians[:-1], medians[-1]


class FusedOps:
    """Fused element-wise layer ops for one dtype; every tensor argument is on the CPU."""

    label: ClassVar[str] = "ours (C)"

    def __init__(self, library: ctypes.CDLL, dtype: torch.dtype) -> None:
        suffix = _SUFFIX[dtype]
        self.dtype = dtype
        self._add_rmsnorm = _function(
            library, f"add_rmsnorm_{suffix}", [_ptr] * 4 + [_long, _long, _float, _int]
        )
        self._rope = _function(library, f"rope_{suffix}", [_ptr] * 4 + [_long] * 4 + [_int])
        self._silu_mul = _function(library, f"silu_mul_{suffix}", [_ptr] * 2 + [_long] * 2 + [_int])
        self._kv_write = _function(
            library,
            f"kv_write_{suffix}",
            [_ptr, _ptr, _long, _long] + [_ptr] * 3 + [_long] * 2 + [_int],
        )

    def rmsnorm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm(x) * weight for a contiguous [rows, dim] x."""
        return self._call_add_rmsnorm(x, None, weight, eps, x.shape)

    def add_rmsnorm(
        self,
        x: torch.Tensor | None,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """residual += x in place (fp32 [rows, dim]; x: None or contiguous, of this dtype);
        returns RMSNorm(residual) * weight in this dtype."""
        return self._call_add_rmsnorm(x, residual, weight, eps, residual.shape)

    def _call_add_rmsnorm(
        self,
        x: torch.Tensor | None,
        residual: torch.Tensor | None,
        weight: torch.Tensor,
        eps: float,
        shape: torch.Size,
    ) -> torch.Tensor:
        rows, dim = shape
        out = torch.empty(shape, dtype=self.dtype)
        self._add_rmsnorm(
            None if x is None else x.data_ptr(),
            None if residual is None else residual.data_ptr(),
            weight.data_ptr(),
            out.data_ptr(),
            rows,
            dim,
            eps,
            torch.get_num_threads(),
        )
        return out

    def rope_(
        self, x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> None:
        """Rotate-half RoPE in place. x: [T, heads, D] with unit head and element strides (a
        column slice of a fused projection is fine); positions: int64 [T];
        cos, sin: fp32 [max_positions, D / 2]."""
        tokens, heads, head_dim = x.shape
        self._rope(
            x.data_ptr(),
            positions.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            tokens,
            heads,
            head_dim,
            x.stride(0),
            torch.get_num_threads(),
        )

    def kv_write(
        self,
        k: torch.Tensor,
        v: torch.Tensor,
        slots: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> None:
        """k_cache[slots[t]] = k[t] and v_cache[slots[t]] = v[t]. k, v: [T, KVH, D] with rows
        of contiguous heads (column slices of one projection are fine); slots: int64 [T];
        caches: contiguous [slots, KVH, D], of this dtype."""
        tokens = slots.shape[0]
        row_len = k_cache.shape[1] * k_cache.shape[2]
        for name, x in (("k", k), ("v", v)):
            if x.dtype != self.dtype or x.shape[0] < tokens or x[0].numel() != row_len:
                raise ValueError(f"{name} must be {self.dtype} rows of {row_len}")
            if x.stride(-1) != 1 or x.stride(-2) != x.shape[-1]:
                raise ValueError(f"{name} must have contiguous rows")
        for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
            if x.dtype != self.dtype or not x.is_contiguous():
                raise ValueError(f"{name} must be contiguous {self.dtype}")
        if slots.dtype != torch.int64 or not slots.is_contiguous():
            raise ValueError("slots must be contiguous int64")
        self._kv_write(
            k.data_ptr(),
            v.data_ptr(),
            k.stride(0),
            v.stride(0),
            slots.data_ptr(),
            k_cache.data_ptr(),
            v_cache.data_ptr(),
            tokens,
            row_len,
            torch.get_num_threads(),
        )

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up: contiguous [rows, 2 * width]; returns silu(gate) * up, [rows, width]."""
        rows, double_width = gate_up.shape
        out = gate_up.new_empty((rows, double_width // 2))
        self._silu_mul(
            gate_up.data_ptr(), out.data_ptr(), rows, double_width // 2, torch.get_num_threads()
        )
        return out


def fused_ops(dtype: torch.dtype, device: torch.device) -> FusedOps | None:
    """The fused element-wise ops for this dtype, or None where they cannot be used."""
    if not kernels_enabled(dtype, device):
        return None
    library = _library("cpu_ops")
    return None if library is None else FusedOps(library, dtype)


@dataclass(frozen=True)
class SamplingKernel:
    """A token per row of fp32 logits at a temperature (0: the argmax), without top-k or top-p,
    and the grammar masks of structured outputs (`csrc/sampling.c`)."""

    function: ctypes._CFuncPtr
    mask_function: ctypes._CFuncPtr

    def mask(self, logits: torch.Tensor, rows: torch.Tensor, bitmask: torch.Tensor) -> None:
        """-inf, in place, over each of `rows` (int64) of fp32 [N, vocab] `logits` where its
        row of `bitmask` (int32 [len(rows), ceil(vocab / 32)]) has the token's bit clear."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or not logits.is_contiguous():
            raise ValueError("logits must be contiguous fp32 [rows, vocab]")
        vocab = logits.shape[1]
        rows = rows.to(torch.int64).contiguous()
        words = -(-vocab // 32)
        if bitmask.dtype != torch.int32 or bitmask.shape != (len(rows), words):
            raise ValueError(f"bitmask must be int32 [{len(rows)}, {words}]")
        bitmask = bitmask.contiguous()
        self.mask_function(
            logits.data_ptr(),
            vocab,
            rows.data_ptr(),
            len(rows),
            bitmask.data_ptr(),
            words,
            torch.get_num_threads(),
        )

    def __call__(
        self, logits: torch.Tensor, inv_temperatures: torch.Tensor, uniforms: torch.Tensor
    ) -> torch.Tensor:
        """int64 [rows]: each row's token, or -1 for a row with a NaN or +inf logit, or every
        logit -inf (masked).
        logits: fp32 [rows, vocab]; inv_temperatures: fp32 [rows] (0 for the argmax);
        uniforms: float64 [rows] in [0, 1]."""
        if logits.dtype != torch.float32 or logits.dim() != 2 or not logits.is_contiguous():
            raise ValueError("logits must be contiguous fp32 [rows, vocab]")
        rows, vocab = logits.shape
        inv_temperatures = inv_temperatures.to(torch.float32).contiguous()
        uniforms = uniforms.to(torch.float64).contiguous()
        if inv_temperatures.shape != (rows,) or uniforms.shape != (rows,):
            raise ValueError("one temperature and one uniform per row")
        tokens = torch.empty(rows, dtype=torch.int64)
        self.function(
            logits.data_ptr(),
            rows,
            vocab,
            inv_temperatures.data_ptr(),
            uniforms.data_ptr(),
            tokens.data_ptr(),
            torch.get_num_threads(),
        )
        return tokens


def sampling_kernel() -> SamplingKernel | None:
    """The compiled sampling kernel, or None where our CPU kernels are off or cannot build."""
    if not kernels_enabled(torch.float32, torch.device("cpu")):
        return None
    library = _library("sampling")
    if library is None:
        return None
    argtypes = [_ptr, _long, _long, _ptr, _ptr, _ptr, _int]
    mask_argtypes = [_ptr, _long, _ptr, _long, _ptr, _long, _int]
    return SamplingKernel(
        _function(library, "sample_rows_f32", argtypes),
        _function(library, "mask_rows_f32", mask_argtypes),
    )

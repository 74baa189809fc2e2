"""Weights kept in a quantized checkpoint's packed blocks, and the CPU kernel that reads them.

A `QuantizedWeight` is a projection's weight as the file holds it: one or more `PackedPart`s
stacked along the output rows (a fused q/k/v may mix formats: llama.cpp's Q4_K_M keeps v in
Q6_K beside q and k in Q4_K). `QuantizedLinearKernel` runs y = x W^T on them through
`csrc/quant_linear.c`, which reads the packed bytes and unpacks them in registers, for a decode
step's rows and a prefill's alike. One path for every row count keeps a row's result independent
of the rows beside it, bit for bit (the activations are quantized per row). A prefill path that
unpacked W once into fp32 for PyTorch's GEMM was measured and dropped: on two Zen 3 cores (AVX2)
it was no faster than the packed kernel on a 1B-shaped layer at 64 and 256 rows, and it made
greedy outputs depend on the batch.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field, replace
from enum import IntEnum

import torch

from bulletserve.model.cpu_kernels import _function, _library, kernels_enabled


class PackedFormat(IntEnum):
    """GGUF block formats the kernel reads packed (the values are ggml's type ids)."""

    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14

    @property
    def block_weights(self) -> int:
        return 256 if self.name.endswith("_K") else 32

    @property
    def block_bytes(self) -> int:
        return _BLOCK_BYTES[self]

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_weights


_BLOCK_BYTES = {
    PackedFormat.Q4_0: 18,
    PackedFormat.Q4_1: 20,
    PackedFormat.Q8_0: 34,
    PackedFormat.Q4_K: 144,
    PackedFormat.Q5_K: 176,
    PackedFormat.Q6_K: 210,
}


@dataclass(frozen=True)
class PackedPart:
    """`data`'s rows (uint8 [rows, row_bytes]) are `rows` output rows of `in_features` weights."""

    format: PackedFormat
    data: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        if self.in_features % self.format.block_weights:
            raise ValueError(
                f"{self.format.name} rows of {self.in_features} weights: not a whole number of "
                f"{self.format.block_weights}-weight blocks"
            )
        expected = self.in_features // self.format.block_weights * self.format.block_bytes
        if self.data.dtype != torch.uint8 or self.data.dim() != 2 or self.data.shape[1] != expected:
            raise ValueError(
                f"{self.format.name} data must be uint8 [rows, {expected}], got "
                f"{self.data.dtype} {tuple(self.data.shape)}"
            )

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    def take_rows(self, index: torch.Tensor) -> PackedPart:
        """These rows, in `index`'s order."""
        return replace(self, data=self.data.index_select(0, index).contiguous())


@dataclass(frozen=True)
class QuantizedWeight:
    """A [out_features, in_features] weight as packed parts stacked along the output rows."""

    parts: tuple[PackedPart, ...]
    in_features: int = field(init=False)
    out_features: int = field(init=False)

    def __post_init__(self) -> None:
        if not self.parts or len({p.in_features for p in self.parts}) != 1:
            raise ValueError("a quantized weight needs parts of one input width")
        object.__setattr__(self, "in_features", self.parts[0].in_features)
        object.__setattr__(self, "out_features", sum(p.rows for p in self.parts))

    @classmethod
    def stack(cls, weights: list[QuantizedWeight]) -> QuantizedWeight:
        """The weights one above the other (a fused projection); neighbouring parts of one
        format are joined, so that a kernel call covers them."""
        parts: list[PackedPart] = []
        for part in (p for w in weights for p in w.parts):
            if parts and parts[-1].format == part.format:
                joined = torch.cat([parts[-1].data, part.data])
                parts[-1] = replace(parts[-1], data=joined)
            else:
                parts.append(part)
        return cls(tuple(parts))

    @property
    def nbytes(self) -> int:
        return sum(p.data.numel() for p in self.parts)

    @property
    def formats(self) -> str:
        return "+".join(p.format.name for p in self.parts)


@dataclass(frozen=True)
class QuantizedLinearKernel:
    """y = x W^T (+ bias) for a `QuantizedWeight` on the CPU; x of fp32 or bf16."""

    linear: ctypes._CFuncPtr
    unpack: ctypes._CFuncPtr
    # Whether activations are quantized to int8 (per 32 or, beside K formats, per 256
    # values), as llama.cpp does (where compiled: AVX2); else the products are the
    # dequantized weights' in fp32.
    int8_activations: bool

    @property
    def label(self) -> str:
        activations = "int8" if self.int8_activations else "fp32"
        return f"ours (C), GGUF blocks packed, {activations} activations"

    def __call__(
        self,
        x: torch.Tensor,
        weight: QuantizedWeight,
        bias: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x W^T (+ bias), in x's dtype; `out`: contiguous fp32 [rows, out_features] memory to
        compute it in (new memory where not given)."""
        if x.shape[-1] != weight.in_features:
            raise ValueError(f"x must be [..., {weight.in_features}], got {tuple(x.shape)}")
        rows_in = x.reshape(-1, weight.in_features).to(torch.float32).contiguous()
        rows = rows_in.shape[0]
        if out is None:
            out = torch.empty((rows, weight.out_features), dtype=torch.float32)
        elif (
            out.shape != (rows, weight.out_features)
            or out.dtype != torch.float32
            or not out.is_contiguous()
        ):
            raise ValueError(
                f"out must be contiguous fp32 [{rows}, {weight.out_features}], "
                f"got {out.dtype} {tuple(out.shape)}"
            )
        start = 0
        for part in weight.parts:
            self._check(
                self.linear(
                    int(part.format),
                    part.data.data_ptr(),
                    part.data.shape[1],
                    rows_in.data_ptr(),
                    weight.in_features,
                    out[:, start:].data_ptr(),
                    weight.out_features,
                    rows,
                    part.rows,
                    weight.in_features,
                    self.int8_activations,
                    torch.get_num_threads(),
                )
            )
            start += part.rows
        if bias is not None:
            out += bias
        return out.to(x.dtype).view(*x.shape[:-1], weight.out_features)

    def dequantize(self, part: PackedPart, ids: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 [len(ids) or rows, in_features]: the part's rows (`ids`, int64, in range), or
        all of them, unpacked."""
        if ids is not None:
            ids = ids.to(torch.int64).contiguous()
        count = part.rows if ids is None else ids.numel()
        out = torch.empty((count, part.in_features), dtype=torch.float32)
        self._check(
            self.unpack(
                int(part.format),
                part.data.data_ptr(),
                part.data.shape[1],
                None if ids is None else ids.data_ptr(),
                count,
                part.in_features,
                out.data_ptr(),
                torch.get_num_threads(),
            )
        )
        return out

    def dequantize_weight(self, weight: QuantizedWeight) -> torch.Tensor:
        """fp32 [out_features, in_features]."""
        return torch.cat([self.dequantize(p) for p in weight.parts])

    @staticmethod
    def _check(code: int) -> None:
        if code:
            raise RuntimeError(f"quantized linear kernel refused its arguments (code {code})")


def quantized_linear_kernel(device: torch.device) -> QuantizedLinearKernel | None:
    """The compiled kernel, or None where our CPU kernels are off or cannot build here."""
    if not kernels_enabled(torch.float32, device):
        return None
    library = _library("quant_linear")
    if library is None:
        return None
    _ptr, _int, _long = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    linear_args = [_int, _ptr, _long, _ptr, _long, _ptr, _long, _long, _long, _long, _int, _int]
    unpack_args = [_int, _ptr, _long, _ptr, _long, _long, _ptr, _int]
    return QuantizedLinearKernel(
        _function(library, "quant_linear_f32", linear_args, _int),
        _function(library, "quant_dequantize_f32", unpack_args, _int),
        bool(_function(library, "quant_linear_int8_activations", [], _int)()),
    )

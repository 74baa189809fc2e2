"""Decode steps replayed as CUDA graphs (`--cuda-graphs`).

A pure-decode batch is padded to a (batch, context) bucket and runs as one graph launch in place
of the ~1,500 kernels an 8B model's step launches from Python (on an H200 a batch of 32 at
context 1024 took 23 ms, host-bound, where reading its weights and KV once takes about 5 ms).
A bucket's graph is captured the first time a batch needs it. Padding rows decode token 0 at
position 0, write their K/V into slot 0 (the null block, which holds only values that masked
positions multiply by zero) and attend to that slot alone, so they stay finite and never touch a
real sequence's cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from bulletserve.engine.runner import SeqWork, context_slots
from bulletserve.kv.pool import KVPool
from bulletserve.model.attention import AttentionMetadata
from bulletserve.model.decoder import DecoderLM

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
SMALLEST_CONTEXT_BUCKET = 256


def bucket(value: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `value`, or None."""
    return next((b for b in buckets if b >= value), None)


def context_buckets(max_model_len: int) -> tuple[int, ...]:
    """Powers of two from 256, the last one cut to `max_model_len`."""
    buckets = []
    size = SMALLEST_CONTEXT_BUCKET
    while size < max_model_len:
        buckets.append(size)
        size *= 2
    return (*buckets, max_model_len)


@dataclass
class PaddedDecode:
    """The static inputs of one bucket, on the device; `fill` writes a real batch into them."""

    input_ids: torch.Tensor  # [batch]
    positions: torch.Tensor  # [batch]
    slot_mapping: torch.Tensor  # [batch]
    decode_slots: torch.Tensor  # [batch, context]
    decode_mask: torch.Tensor  # [batch, 1, 1, context]
    logits_rows: torch.Tensor  # [batch]: every row samples

    @classmethod
    def allocate(cls, batch: int, context: int, device: torch.device) -> PaddedDecode:
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        mask = torch.zeros(batch, 1, 1, context, dtype=torch.bool, device=device)
        mask[:, 0, 0, 0] = True
        rows = torch.arange(batch, device=device)
        return cls(longs(batch), longs(batch), longs(batch), longs(batch, context), mask, rows)

    @property
    def batch(self) -> int:
        return self.input_ids.shape[0]

    @property
    def context(self) -> int:
        return self.decode_slots.shape[1]

    def fill(self, works: list[SeqWork], block_size: int) -> None:
        """Write `works` (one-token decodes, at most `batch` of them, contexts within
        `context`) into the first rows; the rest are padding."""
        n, width = len(works), self.context
        contexts = [w.start + 1 for w in works]
        blocks = -(-width // block_size)
        tables = torch.zeros(n, blocks, dtype=torch.long)
        for row, work in enumerate(works):
            table = work.block_table[:blocks]
            tables[row, : len(table)] = torch.tensor(table, dtype=torch.long)
        slots, valid = context_slots(tables, contexts, block_size, width)
        starts = torch.tensor([w.start for w in works])
        ids = torch.zeros(self.batch, dtype=torch.long)
        ids[:n] = torch.tensor([w.token_ids[0] for w in works])
        positions = torch.zeros(self.batch, dtype=torch.long)
        positions[:n] = starts
        slot_mapping = torch.zeros(self.batch, dtype=torch.long)
        slot_mapping[:n] = slots.gather(1, starts.unsqueeze(1)).squeeze(1)
        all_slots = torch.zeros(self.batch, width, dtype=torch.long)
        all_slots[:n] = slots
        mask = torch.zeros(self.batch, width, dtype=torch.bool)
        mask[:n] = valid
        mask[n:, 0] = True
        self.input_ids.copy_(ids)
        self.positions.copy_(positions)
        self.slot_mapping.copy_(slot_mapping)
        self.decode_slots.copy_(all_slots)
        self.decode_mask.copy_(mask[:, None, None, :])

    def metadata(self) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            prefills=[],
            num_prefill_tokens=0,
            num_tokens=self.input_ids.shape[0],
            decode_slots=self.decode_slots,
            decode_mask=self.decode_mask,
        )


@torch.inference_mode()
def padded_forward(model: DecoderLM, pool: KVPool, inputs: PaddedDecode) -> torch.Tensor:
    """fp32 logits of every row of a padded decode batch (what a graph captures)."""
    hidden = model.embed(inputs.input_ids)
    hidden = model.run_layers(hidden, inputs.positions, pool.layers, inputs.metadata())
    return model.logits(hidden, inputs.logits_rows)


def capture_on_current_stream(
    graph: torch.cuda.CUDAGraph, pool: tuple[int, int], forward: Callable[[], torch.Tensor]
) -> torch.Tensor:
    """Capture `forward()` into `graph` on the caller's stream and return its output tensor.
    Captured there, the graph's kernels belong to that stream's context, so a replay on a
    green-context stream keeps to its SMs (on an H200, a graph captured on an ordinary stream
    and replayed on a green-context stream ran on every SM). The legacy default stream cannot
    be captured; there a new stream of the same context captures. `thread_local`: the other
    lane keeps launching on its own stream meanwhile."""
    current = torch.cuda.current_stream()
    stream = torch.cuda.Stream() if current == torch.cuda.default_stream() else current
    stream.wait_stream(current)
    with torch.cuda.stream(stream):
        forward()  # warm-up: this stream's library handles, workspaces, kernel choices
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            output = forward()
        finally:
            graph.capture_end()
    current.wait_stream(stream)
    return output


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: PaddedDecode
    logits: torch.Tensor


class DecodeGraphs:
    """Captured decode graphs per (stream, batch bucket, context bucket) for one model runner on
    a CUDA device (the engine refuses --cuda-graphs elsewhere). A lane's stream stands for its
    split (each green context has its own streams), so a split's graphs run on its SMs. Used
    from one thread (the engine's, or the decode lane's), which replays on its current stream.
    All graphs share one memory pool: they never run at the same time."""

    def __init__(
        self, model: DecoderLM, pool: KVPool, device: torch.device, max_batch: int, max_len: int
    ) -> None:
        self.model, self.pool, self.device = model, pool, device
        self.batch_buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (
            bucket(max_batch, BATCH_BUCKETS) or max_batch,
        )
        self.context_buckets = context_buckets(max_len)
        self._graphs: dict[tuple[int, int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def fits(self, works: list[SeqWork]) -> bool:
        """Whether `works` is a pure-decode batch within the largest buckets."""
        return (
            bool(works)
            and all(len(w.token_ids) == 1 and w.samples for w in works)
            and len(works) <= self.batch_buckets[-1]
            and max(w.start + 1 for w in works) <= self.context_buckets[-1]
        )

    def run(self, works: list[SeqWork]) -> torch.Tensor:
        """fp32 logits of `works` (rows in order), valid until the next call."""
        key = (
            torch.cuda.current_stream(self.device).cuda_stream,
            bucket(len(works), self.batch_buckets),
            bucket(max(w.start + 1 for w in works), self.context_buckets),
        )
        entry = self._graphs.get(key) or self._capture(key)
        entry.inputs.fill(works, self.pool.block_size)
        entry.graph.replay()
        return entry.logits[: len(works)]

    def _capture(self, key: tuple[int, int, int]) -> _Graph:
        _, batch, context = key
        inputs = PaddedDecode.allocate(batch, context, self.device)
        graph = torch.cuda.CUDAGraph()
        logits = capture_on_current_stream(
            graph, self._pool, lambda: padded_forward(self.model, self.pool, inputs)
        )
        entry = _Graph(graph, inputs, logits)
        self._graphs[key] = entry
        return entry

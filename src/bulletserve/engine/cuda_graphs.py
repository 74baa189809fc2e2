"""Decode steps replayed as CUDA graphs: on by default on CUDA, off with `--enforce-eager`.

A pure-decode batch is padded to a batch bucket and runs as one graph launch in place of the
~1,500 kernels an 8B model's step launches from Python (on an H200 a batch of 32 at context 1024
took 23 ms eager, host-bound, where reading its weights and KV once takes about 5 ms). Attention
reads the KV blocks in place (our Triton decode kernel), so one graph per batch bucket serves
every context length: its inputs are a block table as wide as `--max-model-len` and each row's
context length, updated in place before each replay. Padding rows decode token 0 at position 0
with a context of one token, write their K/V into slot 0 (the null block, which no real context
reads) and attend to that slot alone, so they stay finite and never touch a real sequence's
cache. Memory: every graph shares one pool, which holds the activations of the largest bucket
(they never run at the same time), plus each bucket's input buffers (the block table dominates:
batch x max_model_len / block_size int32s, 1 MB at 256 rows and 16K tokens).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from bulletserve.engine.model_runner import FedTokens, SeqWork, block_tables
from bulletserve.kv.pool import KVPool
from bulletserve.model.attention import AttentionMetadata, DecodeKernel
from bulletserve.model.decoder import DecoderLM

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


def bucket(value: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds `value`, or None."""
    return next((b for b in buckets if b >= value), None)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes graphs are captured at: `BATCH_BUCKETS` up to `max_batch`, which is the
    last (rounded up to a bucket within them)."""
    below = tuple(b for b in BATCH_BUCKETS if b < max_batch)
    return (*below, bucket(max_batch, BATCH_BUCKETS) or max_batch)


@dataclass
class PaddedDecode:
    """The static inputs of one batch bucket, on the device; `fill` writes a batch into them."""

    input_ids: torch.Tensor  # [batch]
    positions: torch.Tensor  # [batch]
    slot_mapping: torch.Tensor  # [batch]
    block_tables: torch.Tensor  # int32 [batch, max_blocks]
    context_lens: torch.Tensor  # int32 [batch]
    logits_rows: torch.Tensor  # [batch]: every row samples

    @classmethod
    def allocate(cls, batch: int, max_blocks: int, device: torch.device) -> PaddedDecode:
        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.long, device=device)

        return cls(
            input_ids=longs(batch),
            positions=longs(batch),
            slot_mapping=longs(batch),
            block_tables=torch.zeros(batch, max_blocks, dtype=torch.int32, device=device),
            context_lens=torch.ones(batch, dtype=torch.int32, device=device),
            logits_rows=torch.arange(batch, device=device),
        )

    @property
    def batch(self) -> int:
        return self.input_ids.shape[0]

    def fill(self, works: list[SeqWork], block_size: int) -> None:
        """Write `works` (one-token decodes, at most `batch` of them, contexts within the block
        table) into the first rows; the rest become padding. One host tensor per input, copied
        in; table columns past the batch's longest context keep stale ids no row reads."""
        n = len(works)
        pad = self.batch - n
        starts = [w.start for w in works]
        slots = [
            w.block_table[w.start // block_size] * block_size + w.start % block_size for w in works
        ]
        host = torch.tensor(
            [
                [w.token_ids[0] for w in works] + [0] * pad,
                starts + [0] * pad,
                slots + [0] * pad,
                [s + 1 for s in starts] + [1] * pad,
            ],
            dtype=torch.long,
        )
        tables = block_tables([w.block_table for w in works], [s + 1 for s in starts], block_size)
        padded = torch.zeros(self.batch, tables.shape[1], dtype=torch.int32)
        padded[:n] = tables
        if self.input_ids.is_cuda:
            # From pinned memory, so that the copies queue behind a step in flight, not wait.
            host, padded = host.pin_memory(), padded.pin_memory()
        self.input_ids.copy_(host[0], non_blocking=True)
        self.positions.copy_(host[1], non_blocking=True)
        self.slot_mapping.copy_(host[2], non_blocking=True)
        self.context_lens.copy_(host[3], non_blocking=True)
        self.block_tables[:, : padded.shape[1]].copy_(padded, non_blocking=True)

    def metadata(self, kernel: DecodeKernel, block_size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            prefills=[],
            num_prefill_tokens=0,
            num_tokens=self.batch,
            decode_kernel=kernel,
            decode_block_tables=self.block_tables,
            decode_context_lens=self.context_lens,
            block_size=block_size,
        )


@torch.inference_mode()
def padded_forward(
    model: DecoderLM, pool: KVPool, inputs: PaddedDecode, kernel: DecodeKernel
) -> torch.Tensor:
    """fp32 logits of every row of a padded decode batch (what a graph captures)."""
    hidden = model.embed(inputs.input_ids)
    meta = inputs.metadata(kernel, pool.block_size)
    hidden = model.run_layers(hidden, inputs.positions, pool.layers, meta)
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
    """Captured decode graphs per (stream, batch bucket) for one model runner on a CUDA device
    whose decode attention reads the blocks in place. A lane's stream stands for its split (each
    green context has its own streams), so a split's graphs run on its SMs. A graph is captured
    the first time its stream runs a batch of its bucket, or ahead of time by `capture`. Used
    from one thread (the engine's, or the decode lane's), which replays on its current stream.
    All graphs share one memory pool: they never run at the same time."""

    def __init__(
        self,
        model: DecoderLM,
        pool: KVPool,
        device: torch.device,
        kernel: DecodeKernel,
        max_batch: int,
        max_len: int,
    ) -> None:
        self.model, self.pool, self.device, self.kernel = model, pool, device, kernel
        self.batch_buckets = batch_buckets(max_batch)
        self.max_blocks = -(-max_len // pool.block_size)
        self._graphs: dict[tuple[int, int], _Graph] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def fits(self, works: list[SeqWork]) -> bool:
        """Whether `works` is a pure-decode batch within the largest bucket."""
        return (
            bool(works)
            and all(len(w.token_ids) == 1 and w.samples for w in works)
            and len(works) <= self.batch_buckets[-1]
            and max(w.start + 1 for w in works) <= self.max_blocks * self.pool.block_size
        )

    def capture(self) -> None:
        """Capture every batch bucket's graph on the current stream, largest first (the shared
        pool is sized by the first)."""
        stream = torch.cuda.current_stream(self.device).cuda_stream
        for batch in sorted(self.batch_buckets, reverse=True):
            if (stream, batch) not in self._graphs:
                self._capture((stream, batch))

    def run(self, works: list[SeqWork], fed: FedTokens | None = None) -> torch.Tensor:
        """fp32 logits of `works` (rows in order), valid until the next call; `fed`: input
        tokens from the last step's draw."""
        key = (
            torch.cuda.current_stream(self.device).cuda_stream,
            bucket(len(works), self.batch_buckets),
        )
        entry = self._graphs.get(key) or self._capture(key)
        entry.inputs.fill(works, self.pool.block_size)
        if fed is not None:
            fed.write(entry.inputs.input_ids, fed.rows)
        entry.graph.replay()
        return entry.logits[: len(works)]

    def _capture(self, key: tuple[int, int]) -> _Graph:
        inputs = PaddedDecode.allocate(key[1], self.max_blocks, self.device)
        graph = torch.cuda.CUDAGraph()
        logits = capture_on_current_stream(
            graph,
            self._pool,
            lambda: padded_forward(self.model, self.pool, inputs, self.kernel),
        )
        entry = _Graph(graph, inputs, logits)
        self._graphs[key] = entry
        return entry

"""Carries out one step on the device: builds the batch, runs the model, returns logits."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from bulletserve.bookkeeping.lane_core import EVERY_UNIT, Placement
from bulletserve.dist.parallel import Channel
from bulletserve.engine.request import Request, TokenLogprob
from bulletserve.kv.pool import KVPool
from bulletserve.model.attention import (
    AttentionMetadata,
    DecodeKernel,
    PrefillKernel,
    PrefillSpan,
    prefill_kernel_outruns_sdpa,
    triton_kernels,
)
from bulletserve.model.cpu_kernels import (
    decode_attention_kernel,
    fused_ops,
    prefill_attention_kernel,
)
from bulletserve.model.decoder import DecoderLM, Linear, LogitsBuffer
from bulletserve.model.file_error import ModelFileError
from bulletserve.model.lora import AdapterStacks, AdapterWeights, lora_batch

# On a CPU, oneDNN (which runs PyTorch's bf16 and fp16 GEMMs, and the oneDNN packed projections
# in any dtype; PyTorch's own fp32 GEMM goes to MKL, and our blocked one to our C, which do
# not) builds (JIT-compiles) a GEMM
# kernel the first time it meets a row count, for each thread count, and caches it: in one
# process, a SmolLM2-135M prefill at a prompt length not met before took 6 ms (17-55 tokens) to
# 22 ms (200-390) more than the same prefill again, its five weight shapes 0.5-7 ms each. A CPU
# step therefore pads its rows above 32 to a multiple of 16 (AMX computes in 16-row tiles),
# which leaves few enough row counts to build them all when the engine starts
# (`warm_cpu_gemms`) and keeps the cache from churning. Below 32 rows padding costs more than it
# saves (17 rows as 32: 1.22x the step); above, 0.98-1.07x.
CPU_EXACT_ROWS = 32
CPU_ROW_MULTIPLE = 16
# Prompt logprobs are computed this many prompt rows at a time.
PROMPT_LOGPROB_ROWS = 64


def builds_gemm_kernels(model: DecoderLM, device: torch.device) -> bool:
    """Whether the model's GEMMs on `device` build a kernel per new row count (see above)."""
    dtype = model.dtype
    packed = model.packed_linear is not None and model.packed_linear.builds_per_row_count
    return device.type == "cpu" and (packed or dtype in (torch.bfloat16, torch.float16))


def padded_rows(rows: int) -> int:
    """The rows a CPU step computes for `rows` tokens (or sampled rows)."""
    if rows <= CPU_EXACT_ROWS:
        return rows
    return -(-rows // CPU_ROW_MULTIPLE) * CPU_ROW_MULTIPLE


@dataclass
class SeqWork:
    """One sequence's share of a step: tokens [start, start + len(token_ids)) of its context.
    With `prompt_targets` (the prompt tokens its rows predict, from position start + 1), the
    runner fills `prompt_logprobs` with each one's logprob, rank and `prompt_top`
    alternatives."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    samples: bool  # whether the step ends at the sequence's last token, so it gets logits
    prompt_targets: list[int] = field(default_factory=list)
    prompt_top: int = 0
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    # With `samples`: how many of its last rows get logits (a verified decode row: its token's
    # and each draft's, 1 + drafts).
    num_logits: int = 1
    lora: AdapterWeights | None = None  # the LoRA adapter its rows run with


def request_work(request: Request, start: int, end: int) -> SeqWork:
    """A request's share of a step over its tokens [start, end); past its tokens, a decode row
    goes on over its drafts, each row's logits kept to verify them."""
    lora = None if request.lora is None else request.lora.weights
    if end > request.num_tokens:
        drafts = request.draft_token_ids[: end - request.num_tokens]
        token_ids = request.token_ids(start, request.num_tokens) + drafts
        return SeqWork(
            token_ids, start, request.block_table, True, num_logits=1 + len(drafts), lora=lora
        )
    return SeqWork(
        request.token_ids(start, end),
        start,
        request.block_table,
        end == request.num_tokens,
        request.prompt_targets(start, end),
        request.params.prompt_logprobs or 0,
        lora=lora,
    )


@dataclass
class StepBatch:
    """Device tensors of one step; prefills come first, then decodes."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_rows: torch.Tensor  # padded on a CPU like the step's rows (repeating the last)
    sampling_order: list[int]  # index into the given works, per logits row (a work's in a run)
    # (index into the given works, its first row) of the works that want prompt logprobs.
    prompt_rows: list[tuple[int, int]] = field(default_factory=list)
    query_starts: list[int] = field(default_factory=list)  # each given work's first row


@dataclass
class FedTokens:
    """Input tokens a step takes from the step before it where that step drew them (on the
    device), not from the host: work `rows[i]`'s one token is `drawn[picks[i]]`
    (--async-scheduling: the step was planned and launched before the host saw those tokens)."""

    rows: list[int]
    drawn: torch.Tensor
    picks: list[int]

    def write(self, input_ids: torch.Tensor, at: list[int]) -> None:
        """Write the fed tokens into `input_ids` at rows `at` (the works' rows there)."""
        device = input_ids.device
        picks = _upload(torch.tensor(self.picks), device)
        tokens = self.drawn.index_select(0, picks).to(input_ids.dtype)
        input_ids.index_copy_(0, _upload(torch.tensor(at), device), tokens)


def _upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`; to a GPU through pinned memory, behind the stream's work
    rather than waiting for it (a pageable copy would wait for the step in flight)."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


@dataclass
class PrefillPass:
    """The device side of a prefill batch's pass through the layers, one layer group a step:
    its works, their inputs, and the hidden states after the layers run so far."""

    works: list[SeqWork]
    batch: StepBatch
    hidden: torch.Tensor | None = None


# What rank 0's runner announces to the other tensor-parallel ranks (`dist.parallel`), each
# before it runs the same on its own shard. Pure data, pickled.


@dataclass
class RunStep:
    """A whole step (`ModelRunner.execute`)."""

    works: list[SeqWork]
    placement: Placement


@dataclass
class RunLayers:
    """A prefill pass's layer group (`ModelRunner.run_layers`); `works` with the first group."""

    works: list[SeqWork] | None
    first: int
    last: int
    placement: Placement


@dataclass
class WarmGemms:
    """`warm_cpu_gemms` on every rank's shard."""

    max_rows: int
    max_sampled_rows: int
    thread_counts: list[int]


@dataclass
class StopRank:
    """The engine is closing: the rank's channel loop ends."""


def context_slots(
    tables: torch.Tensor, contexts: list[int], block_size: int, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache slots of each decoding sequence's context, `width` wide, and their validity.

    tables: [batch, blocks] block ids, blocks * block_size >= width (0 past a table's end).
    Positions past a context (the unwritten tail of its last block, or padding up to `width`)
    read slot 0, the null block: masked scores still multiply V, and stale memory may hold
    NaNs, so they must read something finite."""
    offsets = torch.arange(block_size)
    slots = (tables.long().unsqueeze(2) * block_size + offsets).flatten(1)[:, :width]
    valid = torch.arange(width).unsqueeze(0) < torch.tensor(contexts).unsqueeze(1)
    return torch.where(valid, slots, 0), valid


def block_tables(tables: list[list[int]], contexts: list[int], block_size: int) -> torch.Tensor:
    """int32 [sequences, blocks of the longest context] on the host, 0 past each table's end."""
    width = -(-max(contexts) // block_size)
    return torch.tensor(
        [table[:width] + [0] * (width - len(table[:width])) for table in tables],
        dtype=torch.int32,
    )


class ModelRunner:
    """Runs steps of `model` (one rank's shard under tensor parallelism) on `pool`. On rank 0
    of several, every step is first announced to the other ranks on the calling lane's
    channel (`dist.parallel`); they run it on their shards alongside."""

    def __init__(self, model: DecoderLM, pool: KVPool, device: torch.device) -> None:
        self.model = model
        self.pool = pool
        self.device = device
        self.tp = model.tp
        self.block_size = pool.block_size
        self.lora_stacks = AdapterStacks()  # the LoRA adapter sets steps met, stacked
        self._block_offsets = torch.arange(self.block_size)
        config = model.shard_config
        group = config.num_heads // config.num_kv_heads
        self.decode_kernel: DecodeKernel | None
        self.prefill_kernel: PrefillKernel | None
        if device.type == "cuda":
            self.decode_kernel, self.prefill_kernel = triton_kernels(config.head_dim, group, device)
        else:
            self.decode_kernel = decode_attention_kernel(
                pool.kv.dtype, config.head_dim, group, device
            )
            kernel = prefill_attention_kernel(pool.kv.dtype, config.head_dim, group, device)
            if kernel is not None and not prefill_kernel_outruns_sdpa(
                kernel, config.num_heads, config.num_kv_heads, config.head_dim, pool.kv.dtype
            ):
                kernel = None
            self.prefill_kernel = kernel
        self.kv_writer = fused_ops(pool.kv.dtype, device)
        # Captured decode graphs (engine.cuda_graphs.DecodeGraphs), set by the engine on CUDA
        # unless --enforce-eager; typed loosely here because that module builds on this one.
        self.graphs = None
        # Whether steps pad their rows (padded_rows); tests turn it on and off.
        self.pad_rows = builds_gemm_kernels(model, device)
        if device.type == "cuda":
            # cuDNN's SDPA builds a graph per new shape, and a decode batch's context length
            # changes at every step: on an H200 (torch 2.11) it took 74% of the host's time,
            # 1.97 ms per call, in a 32-prompt run. Flash, memory-efficient or math instead.
            torch.backends.cuda.enable_cudnn_sdp(False)

    def kernels(self) -> str:
        """Which code runs each part of a step, as chosen at load (the startup log's line)."""
        linear = self.model.quantized_kernel or next(
            (m.kernel for m in self.model.modules() if getattr(m, "kernel", None) is not None),
            None,
        )

        def label(kernel: object, fallback: str) -> str:
            return fallback if kernel is None else getattr(kernel, "label", type(kernel).__name__)

        return (
            f"projections {label(linear, 'PyTorch linear')}; "
            f"prefill attention {label(self.prefill_kernel, 'PyTorch SDPA')}; "
            f"decode attention {label(self.decode_kernel, 'PyTorch SDPA')}; "
            f"norms, RoPE, KV writes {label(self.kv_writer, 'PyTorch')}"
        )

    def _slots(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        blocks = torch.tensor(block_table[: -(-end // self.block_size)], dtype=torch.long)
        slots = (blocks.unsqueeze(1) * self.block_size + self._block_offsets).reshape(-1)
        return slots[start:end]

    def prepare(self, works: list[SeqWork]) -> StepBatch:
        prefills = [i for i, w in enumerate(works) if len(w.token_ids) > 1]
        decodes = [i for i, w in enumerate(works) if len(w.token_ids) == 1]
        order = prefills + decodes
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_mapping: list[torch.Tensor] = []
        spans: list[PrefillSpan] = []
        logits_rows: list[int] = []
        sampling_order: list[int] = []
        prompt_rows: list[tuple[int, int]] = []
        query_starts = [0] * len(works)
        # A decode row's position and KV slot are plain integers, gathered into one tensor each
        # (per-row tensor ops cost more than the tiny model's layers at hundreds of rows).
        decode_positions: list[int] = []
        decode_slots: list[int] = []
        size = self.block_size
        for index in order:
            work = works[index]
            query_len = len(work.token_ids)
            end = work.start + query_len
            query_start = len(input_ids)
            query_starts[index] = query_start
            input_ids.extend(work.token_ids)
            if query_len == 1:
                decode_positions.append(work.start)
                decode_slots.append(work.block_table[work.start // size] * size + work.start % size)
            else:
                positions.append(torch.arange(work.start, end))
                slot_mapping.append(self._slots(work.block_table, work.start, end))
                context_slots = mask = None
                if work.start > 0 and self.prefill_kernel is None:
                    context_slots = self._upload(self._slots(work.block_table, 0, end))
                    keys = torch.arange(end)
                    queries = torch.arange(work.start, end)
                    mask = self._upload(keys.unsqueeze(0) <= queries.unsqueeze(1))
                spans.append(PrefillSpan(query_start, query_len, work.start, context_slots, mask))
            if work.samples:
                end_row = query_start + query_len
                logits_rows.extend(range(end_row - work.num_logits, end_row))
                sampling_order.extend([index] * work.num_logits)
            if work.prompt_targets:
                prompt_rows.append((index, query_start))
        if decodes:
            positions.append(torch.tensor(decode_positions, dtype=torch.long))
            slot_mapping.append(torch.tensor(decode_slots, dtype=torch.long))
        num_prefill_tokens = sum(len(works[i].token_ids) for i in prefills)
        num_tokens = len(input_ids)
        if self.pad_rows:
            padding = padded_rows(num_tokens) - num_tokens
            input_ids.extend([0] * padding)
            positions.append(torch.zeros(padding, dtype=torch.long))
            if logits_rows:
                logits_rows.extend(
                    [logits_rows[-1]] * (padded_rows(len(logits_rows)) - len(logits_rows))
                )
        decode_fields: dict = {}
        if decodes:
            decode_fields = self._decode_fields([works[i] for i in decodes])
        if prefills and self.prefill_kernel is not None:
            decode_fields.update(self._prefill_fields([works[i] for i in prefills], spans))
        upload = self._upload
        lora = None
        if any(work.lora is not None for work in works):
            lora = lora_batch(
                [
                    (work.lora, start, start + len(work.token_ids))
                    for work, start in zip(works, query_starts, strict=True)
                ],
                len(input_ids),
                self.lora_stacks,
                self.device,
            )
        meta = AttentionMetadata(
            slot_mapping=upload(torch.cat(slot_mapping)),
            prefills=spans,
            num_prefill_tokens=num_prefill_tokens,
            num_tokens=num_tokens,
            kv_writer=self.kv_writer,
            lora=lora,
            **decode_fields,
        )
        return StepBatch(
            input_ids=upload(torch.tensor(input_ids, dtype=torch.long)),
            positions=upload(torch.cat(positions)),
            meta=meta,
            logits_rows=upload(torch.tensor(logits_rows, dtype=torch.long)),
            sampling_order=sampling_order,
            prompt_rows=prompt_rows,
            query_starts=query_starts,
        )

    def _upload(self, tensor: torch.Tensor) -> torch.Tensor:
        return _upload(tensor, self.device)

    def _prefill_fields(self, works: list[SeqWork], spans: list[PrefillSpan]) -> dict:
        """Attention metadata of the prefilling sequences for our CPU kernel."""
        return {
            "prefill_kernel": self.prefill_kernel,
            "prefill_block_tables": self._upload(
                block_tables(
                    [w.block_table for w in works],
                    [w.start + len(w.token_ids) for w in works],
                    self.block_size,
                )
            ),
            "prefill_spans": self._upload(
                torch.tensor(
                    [
                        [span.query_start for span in spans],
                        [span.query_len for span in spans],
                        [span.cached_len for span in spans],
                    ],
                    dtype=torch.int32,
                )
            ),
            "block_size": self.block_size,
        }

    def _decode_fields(self, works: list[SeqWork]) -> dict:
        """Attention metadata of the decoding sequences, for the kernel or the SDPA path."""
        contexts = [w.start + 1 for w in works]
        tables = block_tables([w.block_table for w in works], contexts, self.block_size)
        if self.decode_kernel is not None:
            return {
                "decode_kernel": self.decode_kernel,
                "decode_block_tables": self._upload(tables),
                "decode_context_lens": self._upload(torch.tensor(contexts, dtype=torch.int32)),
                "block_size": self.block_size,
            }
        slots, valid = context_slots(tables, contexts, self.block_size, max(contexts))
        return {
            "decode_slots": self._upload(slots),
            "decode_mask": self._upload(valid[:, None, None, :]),
        }

    @torch.inference_mode()
    def execute(
        self,
        works: list[SeqWork],
        out: LogitsBuffer | None = None,
        channel: Channel = "decode",
        placement: Placement = EVERY_UNIT,
        fed: FedTokens | None = None,
    ) -> tuple[torch.Tensor, list[int]]:
        """Run one step; return fp32 logits for sampling sequences (in `out`'s memory, if
        given) and their indices in `works`. `channel` and `placement`: the lane it runs for
        and where, as the other ranks are told; `fed`: inputs taken from the last step's draw
        (one rank only: the other ranks are told the works, not the draw)."""
        if (
            self.graphs is not None
            and self.graphs.fits(works)
            and not any(w.prompt_targets for w in works)  # a one-token chunk of a prompt
            and not any(w.lora is not None for w in works)  # the graphs hold no adapter
        ):
            return self.graphs.run(works, fed), list(range(len(works)))
        if fed is not None and self.tp.shard.size > 1:
            raise RuntimeError("fed inputs (--async-scheduling) under tensor parallelism")
        self.tp.announce(channel, RunStep(works, placement))
        batch = self.prepare(works)
        if fed is not None:
            fed.write(batch.input_ids, [batch.query_starts[i] for i in fed.rows])
        with self.tp.on(channel):
            hidden = self.model.embed(batch.input_ids)
            hidden = self.model.run_layers(hidden, batch.positions, self.pool.layers, batch.meta)
            self._prompt_logprobs(hidden, batch, works)
            if not batch.sampling_order:
                return hidden.new_empty((0, self.model.config.vocab_size), dtype=torch.float32), []
            return self.logits(hidden, batch, out), batch.sampling_order

    def begin_pass(self, works: list[SeqWork]) -> PrefillPass:
        """A prefill batch's pass, ready for its first layer group."""
        return PrefillPass(works, self.prepare(works))

    @torch.inference_mode()
    def run_layers(
        self,
        device_pass: PrefillPass,
        first: int,
        last: int,
        out: LogitsBuffer | None = None,
        placement: Placement = EVERY_UNIT,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layers [first, last) of a pass (on the prefill channel): the hidden states after
        them, and after the last layer the logits of the rows that sample (else None). The
        caller keeps the hidden states in the pass for its next group."""
        self.tp.announce(
            "prefill", RunLayers(device_pass.works if first == 0 else None, first, last, placement)
        )
        batch = device_pass.batch
        with self.tp.on("prefill"):
            hidden = device_pass.hidden
            if hidden is None:
                hidden = self.model.embed(batch.input_ids)
            hidden = self.model.run_layers(
                hidden, batch.positions, self.pool.layers, batch.meta, first, last
            )
            logits = None
            if last == self.model.config.num_layers:
                self._prompt_logprobs(hidden, batch, device_pass.works)
                if batch.sampling_order:
                    logits = self.logits(hidden, batch, out)
        return hidden, logits

    @torch.inference_mode()
    def check_finite(self, token_ids: list[int], block_table: list[int]) -> None:
        """Run a short prompt through the model a layer at a time (as a layered prefill pass,
        the other ranks with it) before anything is served: ModelFileError naming the first
        part (the embedding, a layer, the LM head) whose output is not finite, as weights whose
        bytes are of another format, or a NaN epsilon, make it."""
        work = SeqWork(token_ids, 0, block_table, True)
        device_pass = self.begin_pass([work])
        device_pass.hidden = self.model.embed(device_pass.batch.input_ids)
        if not bool(torch.isfinite(device_pass.hidden).all()):
            raise _non_finite("the embedding's rows")
        for layer in range(self.model.config.num_layers):
            hidden, logits = self.run_layers(device_pass, layer, layer + 1)
            device_pass.hidden = hidden
            if not bool(torch.isfinite(hidden).all()):
                raise _non_finite(f"layer {layer}'s output")
        if logits is None or not bool(torch.isfinite(logits).all()):
            raise _non_finite("the LM head's logits")

    def logits(
        self, hidden: torch.Tensor, batch: StepBatch, out: LogitsBuffer | None = None
    ) -> torch.Tensor:
        """fp32 logits of the batch's sampling rows, padding rows dropped."""
        return self.model.logits(hidden, batch.logits_rows, out)[: len(batch.sampling_order)]

    def _prompt_logprobs(
        self, hidden: torch.Tensor, batch: StepBatch, works: list[SeqWork]
    ) -> None:
        """Fill each work's `prompt_logprobs` from the final hidden states of its rows, a few
        rows at a time (a [rows, vocab] fp32 matrix is 200 KB a row for a 49K vocabulary).
        Every rank computes the logits (their columns are gathered on rank 0); rank 0 keeps
        the logprobs."""
        for index, first in batch.prompt_rows:
            work = works[index]
            work.prompt_logprobs = []
            targets = work.prompt_targets
            for at in range(0, len(targets), PROMPT_LOGPROB_ROWS):
                count = min(PROMPT_LOGPROB_ROWS, len(targets) - at)
                rows = list(range(first + at, first + at + count))
                if self.pad_rows:  # the LM head's GEMM at a row count built at start
                    rows += [rows[-1]] * (padded_rows(count) - count)
                logits = self.model.logits(hidden, torch.tensor(rows, device=hidden.device))
                if self.tp.shard.rank != 0:
                    continue
                logprobs = torch.log_softmax(logits[:count].float(), dim=-1)
                wanted = torch.tensor(targets[at : at + count], device=logprobs.device)
                chosen = logprobs.gather(1, wanted.unsqueeze(1))
                ranks = (logprobs > chosen).sum(dim=1) + 1
                top_values, top_ids = logprobs.topk(work.prompt_top, dim=-1)
                work.prompt_logprobs += [
                    TokenLogprob(token, logprob, list(zip(ids, values, strict=True)), rank)
                    for token, logprob, ids, values, rank in zip(
                        wanted.tolist(),
                        chosen.squeeze(1).tolist(),
                        top_ids.tolist(),
                        top_values.tolist(),
                        ranks.tolist(),
                        strict=True,
                    )
                ]


def _non_finite(what: str) -> ModelFileError:
    return ModelFileError(what, "finite values for a short prompt", "NaN or infinite values")


def warm_cpu_gemms(
    model: DecoderLM, max_rows: int, max_sampled_rows: int, thread_counts: list[int]
) -> int:
    """Have oneDNN build the GEMM kernels of every padded row count up to `max_rows` (the LM
    head's up to `max_sampled_rows`), at each of `thread_counts` intra-op threads, so that no
    served step pays for building one. Returns the kernels built. Runs on the calling thread and
    leaves its thread count as it was."""
    projections = {
        (m.in_features, m.out_features, m.bias is not None): m
        for m in model.layers.modules()
        if isinstance(m, Linear) and m.quantized is None  # our quantized kernel builds nothing
    }
    dtype = model.dtype
    gemms = [(module, module.in_features, max_rows) for module in projections.values()]
    if model.quantized_lm_head is None:
        head_rows = min(max_rows, max_sampled_rows)
        gemms.append((model.lm_head_local, model.config.hidden_size, head_rows))
    previous = torch.get_num_threads()
    built = 0
    try:
        with torch.inference_mode():
            for threads in thread_counts:
                torch.set_num_threads(threads)
                for gemm, width, most in gemms:
                    for rows in sorted({padded_rows(n) for n in range(1, most + 1)}):
                        gemm(torch.zeros(rows, width, dtype=dtype))
                        built += 1
    finally:
        torch.set_num_threads(previous)
    return built

"""Workloads: which prompts to send and how many tokens to ask for.

Dataset specs: `sharegpt:PATH` (ShareGPT_V3 JSON: first human turn as prompt, the reply's token
count as output length), `azure:PATH` (Azure LLM inference trace CSV: ContextTokens,
GeneratedTokens and optionally TIMESTAMP; vidur's `num_prefill_tokens, num_decode_tokens,
arrived_at` columns are read too), `random`, the synthetic presets in `lengths`, and the
workloads with shared prefixes in `shared` (`shared-prefix`, `multi-turn`), and `grounded`
(copy, quote, rewrite or summarize a passage of real text or code: `grounded`).
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from bulletserve.bench.grounded import GROUNDED, grounded_requests
from bulletserve.bench.lengths import (
    SHAREGPT_MAX_INPUT,
    SHAREGPT_MAX_TOTAL,
    SHAREGPT_MIN_LEN,
    TABLES,
    fit_to_context,
    sample_sharegpt_like,
    sample_table,
)
from bulletserve.bench.prompts import PromptBuilder
from bulletserve.bench.shared import SHARED_PREFIX_KINDS, shared_prompts
from bulletserve.sched.slo import SLO

PRESETS = ("sharegpt-like", "azure-code-like", "arxiv-sum-like")

# SLOs the Bullet paper uses per workload (normalized TTFT ms/token, TPOT ms).
PAPER_SLOS = {
    "sharegpt": SLO(3.0, 150.0),
    "azure": SLO(1.5, 200.0),
    "arxiv": SLO(1.5, 175.0),
}

_AZURE_COLUMNS = (
    ("ContextTokens", "GeneratedTokens", "TIMESTAMP"),
    ("num_prefill_tokens", "num_decode_tokens", "arrived_at"),
)


class DatasetError(ValueError):
    """A dataset spec or file that cannot be used; the message names the file and the format."""


@dataclass(frozen=True)
class WorkloadRequest:
    """One request to send: its prompt, the prompt's token count and the output tokens asked."""

    prompt: str
    input_len: int
    output_len: int
    timestamp: float | None = None  # the trace's own arrival time, seconds, if any


@dataclass(frozen=True)
class RandomLengths:
    """`random` dataset: lengths uniform in [len * (1 - ratio), len * (1 + ratio)] (vLLM's)."""

    input_len: int = 1024
    output_len: int = 128
    range_ratio: float = 0.0


def dataset_family(spec: str) -> str | None:
    """The workload a spec stands for ("sharegpt", "azure", "arxiv"), for default SLOs."""
    name = spec.split(":", 1)[0]
    for family in PAPER_SLOS:
        if name.startswith(family):
            return family
    return None


def load_workload(
    spec: str,
    num_prompts: int,
    tokenizer: PreTrainedTokenizerBase,
    seed: int = 0,
    max_model_len: int | None = None,
    random_lengths: RandomLengths | None = None,
) -> list[WorkloadRequest]:
    """num_prompts requests of the given dataset, with prompts of exact token lengths."""
    if num_prompts < 1:
        raise DatasetError("--num-prompts must be at least 1")
    kind, _, path = spec.partition(":")
    builder = PromptBuilder(tokenizer, seed)
    if kind == "sharegpt" and path:
        rng = np.random.default_rng(seed)
        return _sharegpt_file(Path(path), num_prompts, builder, rng, max_model_len)
    if kind in SHARED_PREFIX_KINDS and not path:
        return _shared_prefix_requests(kind, num_prompts, builder, seed, max_model_len)
    if kind == GROUNDED and not path:
        return [
            WorkloadRequest(r.prompt, r.input_len, r.output_len)
            for r in grounded_requests(num_prompts, tokenizer, seed, max_model_len)
        ]
    lengths = load_lengths(spec, num_prompts, seed, max_model_len, random_lengths)
    return [WorkloadRequest(builder.build(i), i, o, t) for i, o, t in lengths]


def load_lengths(
    spec: str,
    num_prompts: int,
    seed: int = 0,
    max_model_len: int | None = None,
    random_lengths: RandomLengths | None = None,
) -> list[tuple[int, int, float | None]]:
    """(input tokens, output tokens, trace timestamp) of num_prompts requests, without prompts:
    the same draws as `load_workload` for the same seed (the simulator's path). `sharegpt:PATH`
    needs a tokenizer to count its texts and is not available here."""
    if num_prompts < 1:
        raise DatasetError("--num-prompts must be at least 1")
    kind, _, path = spec.partition(":")
    rng = np.random.default_rng(seed)
    if kind == "sharegpt" and path:
        raise DatasetError("sharegpt:PATH needs a tokenizer to count lengths; use sharegpt-like")
    if kind == GROUNDED:
        raise DatasetError("grounded's lengths are its passages' tokens: it needs a tokenizer")
    if kind == "azure" and path:
        rows = _azure_file(Path(path), num_prompts)
        pairs = [(i, o) for i, o, _ in rows]
        if max_model_len:
            pairs = fit_to_context(pairs, max_model_len)
        return [(i, o, t) for (i, o), (_, _, t) in zip(pairs, rows, strict=True)]
    if path:
        raise DatasetError(f"dataset {kind!r} takes no path; file datasets: sharegpt:, azure:")
    if kind in SHARED_PREFIX_KINDS:
        prompts = shared_prompts(kind, num_prompts, seed, max_model_len)
        return [(p.input_len, p.output_len, None) for p in prompts]
    if kind == "random":
        pairs = _random_pairs(random_lengths or RandomLengths(), num_prompts, rng)
    elif kind == "sharegpt-like":
        pairs = sample_sharegpt_like(num_prompts, rng)
    elif kind in TABLES:
        pairs = sample_table(TABLES[kind], num_prompts, rng)
    else:
        raise DatasetError(
            f"unknown dataset {spec!r}; expected sharegpt:PATH, azure:PATH, random, "
            + ", ".join((*PRESETS, *SHARED_PREFIX_KINDS, GROUNDED))
        )
    if max_model_len and kind != "random":
        pairs = fit_to_context(pairs, max_model_len)
    return [(i, o, None) for i, o in pairs]


def _shared_prefix_requests(
    kind: str, num_prompts: int, builder: PromptBuilder, seed: int, max_model_len: int | None
) -> list[WorkloadRequest]:
    """Prompts of shared segments: each segment's text built once, so that requests naming it
    send the same tokens."""
    texts: dict[str, str] = {}
    requests = []
    for prompt in shared_prompts(kind, num_prompts, seed, max_model_len):
        for segment in prompt.segments:
            if segment.key not in texts:
                texts[segment.key] = builder.build(segment.length)
        text = "".join(texts[segment.key] for segment in prompt.segments)
        requests.append(WorkloadRequest(text, len(builder.count(text)), prompt.output_len))
    return requests


def _random_pairs(
    lengths: RandomLengths, n: int, rng: np.random.Generator
) -> list[tuple[int, int]]:
    if not 0 <= lengths.range_ratio < 1:
        raise DatasetError("--range-ratio must be in [0, 1)")
    if lengths.input_len < 1 or lengths.output_len < 1:
        raise DatasetError("--input-len and --output-len must be at least 1")

    def draw(length: int) -> list[int]:
        low = max(1, int(length * (1 - lengths.range_ratio)))
        high = max(low, int(length * (1 + lengths.range_ratio)))
        return rng.integers(low, high + 1, size=n).tolist()

    return list(zip(draw(lengths.input_len), draw(lengths.output_len), strict=True))


def _sharegpt_file(
    path: Path,
    n: int,
    builder: PromptBuilder,
    rng: np.random.Generator,
    max_model_len: int | None,
) -> list[WorkloadRequest]:
    expected = 'a JSON list of {"conversations": [{"from": "human", "value": ...}, ...]}'
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read the ShareGPT file ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: not JSON ({exc}); expected {expected}") from None
    if not isinstance(data, list):
        raise DatasetError(f"{path}: expected {expected}")
    max_total = min(SHAREGPT_MAX_TOTAL, max_model_len or SHAREGPT_MAX_TOTAL)
    requests: list[WorkloadRequest] = []
    for index in rng.permutation(len(data)).tolist():
        turns = data[index].get("conversations") if isinstance(data[index], dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        try:
            prompt, reply = str(turns[0]["value"]), str(turns[1]["value"])
        except (KeyError, TypeError):
            raise DatasetError(
                f"{path}: entry {index} has no turn values; expected {expected}"
            ) from None
        input_len, output_len = len(builder.count(prompt)), len(builder.count(reply))
        if (
            min(input_len, output_len) >= SHAREGPT_MIN_LEN
            and input_len <= SHAREGPT_MAX_INPUT
            and input_len + output_len <= max_total
        ):
            requests.append(WorkloadRequest(prompt, input_len, output_len))
            if len(requests) == n:
                return requests
    raise DatasetError(
        f"{path}: only {len(requests)} usable conversations for --num-prompts {n} "
        f"(need >= 2 turns, >= {SHAREGPT_MIN_LEN} tokens each, prompt <= {SHAREGPT_MAX_INPUT}, "
        f"total <= {max_total})"
    )


def _azure_file(path: Path, n: int) -> list[tuple[int, int, float | None]]:
    """The first n rows of an Azure trace: (input tokens, output tokens, timestamp or None)."""
    expected = "a CSV with columns ContextTokens, GeneratedTokens and optionally TIMESTAMP"
    try:
        with path.open(newline="") as handle:
            reader = csv.DictReader(handle)
            header = reader.fieldnames or []
            columns = next((c for c in _AZURE_COLUMNS if set(c[:2]) <= set(header)), None)
            if columns is None:
                raise DatasetError(f"{path}: found columns {header}; expected {expected}")
            rows = []
            for line, row in enumerate(reader, start=2):
                if len(rows) == n:
                    break
                try:
                    stamp = row.get(columns[2])
                    rows.append(
                        (
                            max(1, int(float(row[columns[0]]))),
                            max(1, int(float(row[columns[1]]))),
                            _timestamp(stamp) if stamp else None,
                        )
                    )
                except (TypeError, ValueError):
                    raise DatasetError(
                        f"{path}, line {line}: bad value; expected {expected}"
                    ) from None
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read the Azure trace ({exc.strerror})") from None
    if len(rows) < n:
        raise DatasetError(f"{path}: has {len(rows)} requests, fewer than --num-prompts {n}")
    return rows


def _timestamp(value: str) -> float:
    """Seconds, from a number or a date-time such as 2023-11-16 18:15:46.6805900."""
    try:
        return float(value)
    except ValueError:
        pass
    whole, _, fraction = value.strip().partition(".")
    seconds = datetime.fromisoformat(whole).timestamp()
    return seconds + (float("0." + fraction) if fraction else 0.0)

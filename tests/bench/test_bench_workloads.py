"""Workloads: exact prompt token counts, dataset files and their errors, preset distributions."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from bulletserve.bench.datasets import (
    DatasetError,
    RandomLengths,
    dataset_family,
    load_lengths,
    load_workload,
)
from bulletserve.bench.lengths import (
    ARXIV_SUM,
    AZURE_CODE,
    QUANTILES,
    SHAREGPT_MAX_INPUT,
    SHAREGPT_MAX_TOTAL,
    fit_to_context,
    sample_sharegpt_like,
    sample_table,
)
from bulletserve.bench.prompts import PromptBuilder
from tests.tiny_models import needs_default_model

TRACES = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "traces"


@needs_default_model
def test_prompts_have_exact_token_counts(tokenizer):
    builder = PromptBuilder(tokenizer, seed=5)
    lengths = [1, 2, 3, 7, 64, 511, 2048, 4000, *np.random.default_rng(0).integers(1, 3000, 40)]
    for length in lengths:
        prompt = builder.build(int(length))
        assert len(tokenizer.encode(prompt, add_special_tokens=False)) == length
        assert len(tokenizer.encode(prompt)) == length  # what a server's default encode counts


@needs_default_model
def test_prompts_differ_between_requests(tokenizer):
    builder = PromptBuilder(tokenizer, seed=0)
    assert builder.build(50) != builder.build(50)


@needs_default_model
def test_random_dataset_lengths(tokenizer):
    lengths = RandomLengths(input_len=100, output_len=20, range_ratio=0.5)
    workload = load_workload("random", 200, tokenizer, seed=1, random_lengths=lengths)
    assert len(workload) == 200
    assert all(50 <= w.input_len <= 150 and 10 <= w.output_len <= 30 for w in workload)
    assert len({w.input_len for w in workload}) > 20
    for w in workload[:20]:
        assert len(tokenizer.encode(w.prompt, add_special_tokens=False)) == w.input_len
    fixed = load_workload("random", 5, tokenizer, random_lengths=RandomLengths(33, 7))
    assert {(w.input_len, w.output_len) for w in fixed} == {(33, 7)}


@needs_default_model
@pytest.mark.parametrize("preset", ["sharegpt-like", "azure-code-like", "arxiv-sum-like"])
def test_presets_fit_a_short_context(tokenizer, preset):
    workload = load_workload(preset, 30, tokenizer, seed=2, max_model_len=512)
    assert all(w.input_len + w.output_len <= 512 for w in workload)
    for w in workload[:5]:
        assert len(tokenizer.encode(w.prompt, add_special_tokens=False)) == w.input_len


def test_preset_tables_reproduce_the_trace_means():
    rng = np.random.default_rng(0)
    code = np.array(sample_table(AZURE_CODE, 20_000, rng))
    assert code[:, 0].mean() == pytest.approx(2047.8, rel=0.05)  # splitwise_code.csv means
    assert code[:, 1].mean() == pytest.approx(27.9, rel=0.10)
    arxiv = np.array(sample_table(ARXIV_SUM, 20_000, rng))
    assert arxiv[:, 0].mean() == pytest.approx(2588.1, rel=0.05)
    assert arxiv[:, 1].mean() == pytest.approx(291.4, rel=0.10)
    assert np.corrcoef(arxiv[:, 0], arxiv[:, 1])[0, 1] < -0.05  # longer papers, shorter summaries


def test_sharegpt_like_follows_vllms_filter():
    pairs = np.array(sample_sharegpt_like(5000, np.random.default_rng(0)))
    assert pairs.min() >= 4
    assert pairs[:, 0].max() <= SHAREGPT_MAX_INPUT
    assert pairs.sum(axis=1).max() <= SHAREGPT_MAX_TOTAL
    assert 100 < pairs[:, 0].mean() < 200 and 200 < pairs[:, 1].mean() < 400


def test_fit_to_context_keeps_the_shape():
    pairs = [(1000, 100), (4000, 400), (500, 50)] * 40
    fitted = fit_to_context(pairs, 1100)
    assert all(i + o <= 1100 for i, o in fitted)
    assert fitted[0][0] / fitted[0][1] == pytest.approx(10, rel=0.05)
    assert fitted[2][0] < fitted[0][0] < fitted[1][0]
    assert fit_to_context(pairs, 100_000) == pairs


def test_dataset_family_picks_the_papers_slos():
    assert dataset_family("sharegpt:/x.json") == "sharegpt"
    assert dataset_family("azure-code-like") == "azure"
    assert dataset_family("arxiv-sum-like") == "arxiv"
    assert dataset_family("random") is None


@needs_default_model
def test_sharegpt_file(tokenizer, tmp_path):
    entries = [
        {"conversations": [{"from": "human", "value": f"Question {i}: " + "tell me more " * i},
                           {"from": "gpt", "value": "An answer that is long enough. " * (i + 1)}]}
        for i in range(1, 12)
    ] + [{"conversations": [{"from": "human", "value": "only one turn"}]}]  # fmt: skip
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(entries))
    workload = load_workload(f"sharegpt:{path}", 5, tokenizer, seed=0)
    assert len(workload) == 5
    for w in workload:
        assert w.prompt.startswith("Question")
        assert w.input_len == len(tokenizer.encode(w.prompt, add_special_tokens=False))
    with pytest.raises(DatasetError, match="only 11 usable conversations"):
        load_workload(f"sharegpt:{path}", 50, tokenizer)


@needs_default_model
def test_azure_file_with_timestamps(tokenizer, tmp_path):
    path = tmp_path / "azure.csv"
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,12,3\n"
        "2023-11-16 18:15:47.1805900,30,9\n"
    )
    workload = load_workload(f"azure:{path}", 2, tokenizer)
    assert [(w.input_len, w.output_len) for w in workload] == [(12, 3), (30, 9)]
    assert workload[1].timestamp - workload[0].timestamp == pytest.approx(0.5)


@needs_default_model
@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("bad.json", "{not json", "bad.json: not JSON"),
        ("dict.json", '{"a": 1}', "dict.json: expected a JSON list"),
        ("cols.csv", "a,b\n1,2\n", "cols.csv: found columns \\['a', 'b'\\]; expected a CSV"),
        ("vals.csv", "ContextTokens,GeneratedTokens\nx,2\n", "vals.csv, line 2: bad value"),
    ],
)
def test_malformed_files_name_the_file_and_the_format(tokenizer, tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    kind = "sharegpt" if name.endswith(".json") else "azure"
    with pytest.raises(DatasetError, match=message):
        load_workload(f"{kind}:{path}", 1, tokenizer)


@needs_default_model
def test_unknown_or_missing_datasets(tokenizer, tmp_path):
    with pytest.raises(DatasetError, match="unknown dataset 'nope'"):
        load_workload("nope", 1, tokenizer)
    with pytest.raises(DatasetError, match="cannot read"):
        load_workload(f"azure:{tmp_path / 'missing.csv'}", 1, tokenizer)


@pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/data/traces is not present")
@pytest.mark.parametrize(
    ("file", "table"),
    [
        ("splitwise_code.csv", AZURE_CODE),
        ("arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv", ARXIV_SUM),
    ],
)
def test_committed_tables_derive_from_the_traces(file, table):
    with (TRACES / file).open() as handle:
        rows = list(csv.DictReader(handle))
    inputs = np.array([float(r["num_prefill_tokens"]) for r in rows])
    outputs = np.array([float(r["num_decode_tokens"]) for r in rows])
    assert np.rint(np.percentile(inputs, QUANTILES)).tolist() == list(table.input_q)
    assert np.rint(np.percentile(outputs, QUANTILES)).tolist() == list(table.output_q)


@needs_default_model
@pytest.mark.skipif(not TRACES.is_dir(), reason="../shared/data/traces is not present")
def test_reads_the_vidur_azure_trace(tokenizer):
    workload = load_workload(f"azure:{TRACES / 'splitwise_code.csv'}", 50, tokenizer, 0, 1024)
    assert len(workload) == 50
    assert all(w.timestamp is not None and w.input_len + w.output_len <= 1024 for w in workload)


def test_grounded_requests_copy_real_passages_and_fit_the_context(tokenizer):
    """Each prompt holds a passage of the shipped texts or the package's code; it asks for as
    many tokens as the passage has; the same seed gives the same workload."""
    workload = load_workload("grounded", 24, tokenizer, seed=3, max_model_len=1024)
    assert workload == load_workload("grounded", 24, tokenizer, seed=3, max_model_len=1024)
    assert any("```python" in w.prompt for w in workload)
    assert any("Copy the following text exactly" in w.prompt for w in workload)
    for w in workload:
        assert w.input_len == len(tokenizer.encode(w.prompt, add_special_tokens=False))
        assert w.output_len < w.input_len and w.input_len + w.output_len <= 1024
    with pytest.raises(DatasetError, match="needs a tokenizer"):
        load_lengths("grounded", 4)

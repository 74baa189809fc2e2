"""Request-length distributions of the synthetic presets, and scaling to a short context.

`azure-code-like` and `arxiv-sum-like` are quantile tables of the real traces, with a Gaussian
copula for the dependence between input and output lengths. Derived by us from microsoft/vidur
`data/processed_traces/` (MIT License, commit 7d47513): `splitwise_code.csv` (8,819 requests of
the Azure LLM inference trace, code service; Patel et al., "Splitwise", ISCA 2024) and
`arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv` (28,257 arXiv summarization
requests), both counted with the Llama-2 tokenizer. Quantiles are numpy's linear percentiles at
QUANTILES; `rho` is the correlation of the normal scores of input and output lengths.

`sharegpt-like` follows the ShareGPT statistics published with vLLM (Kwon et al., "Efficient
Memory Management for Large Language Model Serving with PagedAttention", SOSP 2023, Sec. 6.1
and Fig. 11: mean input 161.31 and mean output 337.99 tokens, "8.4x longer inputs and 5.8x
longer outputs than Alpaca" at 19.31 / 58.45). The paper gives means only: the log-normal shape
(sigma 1.0, independent lengths) is our assumption, and samples are kept within the filter that
vLLM's ShareGPT loader applies (at least 4 tokens each, input <= 1024, input + output <= 2048).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

import numpy as np

QUANTILES = (0, 1, 2.5, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70, 75, 80, 85, 90,
             95, 97.5, 99, 99.5, 99.9, 100)  # fmt: skip


@dataclass(frozen=True)
class QuantileTable:
    """Input and output length quantiles at QUANTILES, and their normal-score correlation."""

    input_q: tuple[int, ...]
    output_q: tuple[int, ...]
    rho: float


# Azure-Code (splitwise_code.csv): mean input 2047.8, mean output 27.9 tokens.
AZURE_CODE = QuantileTable(
    input_q=(3, 17, 44, 75, 147, 232, 386, 578, 770, 939, 1075, 1261, 1469, 1690, 1909, 2164,
             2433, 2744, 3192, 3920, 5188, 7303, 7435, 7436, 7436, 7437, 7437),
    output_q=(6, 6, 6, 6, 7, 7, 8, 9, 9, 10, 11, 12, 13, 14, 16, 18, 20, 24, 29, 39, 55, 90,
              145, 251, 359, 825, 1899),
    rho=-0.013,
)  # fmt: skip

# arXiv-Summary (arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv): mean input 2588.1,
# mean output 291.4 tokens.
ARXIV_SUM = QuantileTable(
    input_q=(1, 73, 331, 749, 1242, 1564, 1802, 1986, 2150, 2308, 2453, 2596, 2730, 2861, 2996,
             3127, 3249, 3370, 3490, 3597, 3702, 3813, 3876, 3933, 3963, 4012, 4054),
    output_q=(5, 36, 48, 60, 78, 92, 104, 115, 125, 135, 145, 156, 167, 179, 192, 206, 222, 242,
              268, 304, 372, 736, 2507, 3271, 3582, 3844, 4056),
    rho=-0.207,
)  # fmt: skip

SHAREGPT_MEAN_INPUT = 161.31
SHAREGPT_MEAN_OUTPUT = 337.99
SHAREGPT_SIGMA = 1.0
SHAREGPT_MAX_INPUT = 1024
SHAREGPT_MAX_TOTAL = 2048
SHAREGPT_MIN_LEN = 4

TABLES = {"azure-code-like": AZURE_CODE, "arxiv-sum-like": ARXIV_SUM}


def sample_table(table: QuantileTable, n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """n (input, output) length pairs by inverse-CDF sampling through a Gaussian copula."""
    z1 = rng.standard_normal(n)
    z2 = table.rho * z1 + math.sqrt(1 - table.rho**2) * rng.standard_normal(n)
    cdf = NormalDist().cdf
    u_in = np.array([cdf(z) for z in z1]) * 100
    u_out = np.array([cdf(z) for z in z2]) * 100
    inputs = np.interp(u_in, QUANTILES, table.input_q)
    outputs = np.interp(u_out, QUANTILES, table.output_q)
    return [(max(1, round(i)), max(1, round(o))) for i, o in zip(inputs, outputs, strict=True)]


def sample_sharegpt_like(n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """n (input, output) pairs: log-normal with ShareGPT's published means, vLLM's filter."""
    pairs: list[tuple[int, int]] = []
    mu_in = math.log(SHAREGPT_MEAN_INPUT) - SHAREGPT_SIGMA**2 / 2
    mu_out = math.log(SHAREGPT_MEAN_OUTPUT) - SHAREGPT_SIGMA**2 / 2
    for _ in range(100):  # each round keeps most draws; 100 rounds is far more than needed
        inputs = np.rint(rng.lognormal(mu_in, SHAREGPT_SIGMA, 2 * n)).astype(int)
        outputs = np.rint(rng.lognormal(mu_out, SHAREGPT_SIGMA, 2 * n)).astype(int)
        for i, o in zip(inputs.tolist(), outputs.tolist(), strict=True):
            if (
                min(i, o) >= SHAREGPT_MIN_LEN
                and i <= SHAREGPT_MAX_INPUT
                and i + o <= SHAREGPT_MAX_TOTAL
            ):
                pairs.append((i, o))
        if len(pairs) >= n:
            return pairs[:n]
    raise RuntimeError("sharegpt-like sampling did not converge")


def fit_to_context(pairs: list[tuple[int, int]], max_model_len: int) -> list[tuple[int, int]]:
    """Shrink lengths for a short context, keeping the shape of the distribution.

    All lengths are multiplied by max_model_len / (P99 input + P99 output) when that is below 1;
    the few requests still too long are then shrunk, input and output alike, to fit.
    """
    if not pairs:
        return pairs
    inputs = np.array([i for i, _ in pairs])
    outputs = np.array([o for _, o in pairs])
    p99 = float(np.percentile(inputs, 99) + np.percentile(outputs, 99))
    factor = min(1.0, max_model_len / p99)
    fitted = []
    for i, o in pairs:
        i, o = max(1, round(i * factor)), max(1, round(o * factor))
        if i + o > max_model_len:
            shrink = max_model_len / (i + o)
            i, o = max(1, math.floor(i * shrink)), max(1, math.floor(o * shrink))
        fitted.append((i, o))
    return fitted

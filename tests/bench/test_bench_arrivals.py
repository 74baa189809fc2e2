"""Arrival processes: rate, burstiness, reproducibility, trace timestamps."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bulletserve.bench.arrivals import arrival_times, interarrival_gaps, trace_arrival_times


@pytest.mark.parametrize("rate", [0.5, 4.0, 25.0])
def test_mean_interval_matches_rate(rate):
    gaps = interarrival_gaps(10_000, rate, 1.0, seed=7)
    assert abs(gaps.mean() - 1 / rate) < 0.05 / rate


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_burstiness_sets_the_spread(burstiness):
    gaps = interarrival_gaps(10_000, 2.0, burstiness, seed=3)
    assert abs(gaps.mean() - 0.5) < 0.05 * 0.5
    cv = gaps.std() / gaps.mean()  # a gamma with shape k has CV 1/sqrt(k)
    assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.07)


def test_arrivals_end_at_n_over_rate_and_are_reproducible():
    times = arrival_times(1000, 8.0, 1.0, seed=1)
    assert times[-1] == pytest.approx(1000 / 8.0)
    assert np.all(np.diff(times) >= 0)
    assert times == arrival_times(1000, 8.0, 1.0, seed=1)
    assert times != arrival_times(1000, 8.0, 1.0, seed=2)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(5, math.inf) == [0.0] * 5


def test_bad_rate_or_burstiness():
    with pytest.raises(ValueError):
        interarrival_gaps(10, 0.0, 1.0, 0)
    with pytest.raises(ValueError):
        interarrival_gaps(10, 1.0, 0.0, 0)


def test_trace_arrivals_keep_or_rescale_the_trace():
    stamps = [100.0, 100.5, 101.0, 104.0]
    assert trace_arrival_times(stamps, math.inf) == [0.0, 0.5, 1.0, 4.0]
    scaled = trace_arrival_times(stamps, 2.0)  # 4 requests at 2/s: the last is due at 2 s
    assert scaled == pytest.approx([0.0, 0.25, 0.5, 2.0])

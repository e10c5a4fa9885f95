"""The SLO (keyscale.scaling.slo): the text users give, and what the window measures of it."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from keyscale.errors import KeyscaleError
from keyscale.latency import ages, at_commit
from keyscale.scaling.load import Sample
from keyscale.scaling.slo import Slo, lag_seconds, parse_slo, read_slo


@given(st.sampled_from(["latency", "lag"]), st.floats(min_value=1e-3, max_value=1e6, allow_nan=False))
def test_every_slo_reads_back_from_its_text(kind: str, seconds: float) -> None:
    slo = Slo(kind, seconds)  # type: ignore[arg-type]
    assert parse_slo(str(slo)) == slo


@pytest.mark.parametrize(("text", "kind", "seconds"), [
    ("latency=5s", "latency", 5.0), ("lag=30s", "lag", 30.0), ("LAG = 2 min", "lag", 120.0),
    ("latency=250ms", "latency", 0.25), ("lag=1h", "lag", 3600.0), ("latency=1.5seconds", "latency", 1.5),
])
def test_the_forms_users_write(text: str, kind: str, seconds: float) -> None:
    assert parse_slo(text) == Slo(kind, seconds)  # type: ignore[arg-type]


@pytest.mark.parametrize(("text", "says"), [
    ("latency", "expected KIND=DURATION"),
    ("p99=5s", "'p99' is not an SLO keyscale measures"),
    ("latency=5", "'5' is not a duration"),
    ("latency=5 parsecs", "'5 parsecs' is not a duration"),
    ("lag=0s", "longer than 0"),
    ("lag=-3s", "'-3s' is not a duration"),
])
def test_errors_name_the_bad_text(text: str, says: str) -> None:
    with pytest.raises(KeyscaleError) as e:
        parse_slo(text)
    assert f"--slo {text!r}" in str(e.value) and says in str(e.value)


def _sample(t: float, backlog: int | None, rate: float = 100.0, seconds: float = 1.0, latency: object = None) -> Sample:
    return Sample(t, 5.0, rate, 500, 1.0, 1.0, warmup=False, latency=latency, backlog=backlog, seconds=seconds)  # type: ignore[arg-type]


def test_lag_is_the_batch_plus_the_backlog_at_the_input_rate() -> None:
    assert lag_seconds(_sample(0.0, 0)) == 1.0  # what arrived while the batch ran
    assert lag_seconds(_sample(0.0, None)) == 1.0
    assert lag_seconds(_sample(0.0, 2000, rate=100.0)) == 21.0
    assert lag_seconds(_sample(0.0, 2000, rate=0.0)) is None  # a backlog and no input: age unknown


def test_latency_is_the_windows_p99_from_the_batches_histograms() -> None:
    # 99 records 1 s late and one 20 s late in one batch, 100 records 1 s late in the next:
    # the window's p99 is 1 s (the 198th of 200), a batch's alone would be 20 s.
    slow = at_commit([ages(np.array([0.0] * 99 + [-19.0]), 1.0, "t")], 1.0)
    fast = at_commit([ages(np.array([0.0] * 100), 1.0, "t")], 1.0)
    window = [_sample(0.0, 0, latency=slow), _sample(5.0, 0, latency=fast)]
    r = read_slo(Slo("latency", 5.0), window, horizon=5.0)
    assert r.value == pytest.approx(1.0, rel=0.05) and r.how == "p99 latency over 2 batches"
    assert not r.missed and not r.at_risk and r.attainment == 1.0 and r.to_dict()["state"] == "met"


def test_without_append_times_latency_is_estimated_and_says_so() -> None:
    r = read_slo(Slo("latency", 5.0), [_sample(0.0, 1000, rate=100.0, seconds=2.0)], horizon=5.0)
    assert r.value == 14.0 and r.missed and "estimated from the lag" in r.how  # lag 12 s, + one batch
    assert r.attainment == pytest.approx(5 / 14)


def test_a_rising_lag_is_about_to_miss_before_it_misses() -> None:
    window = [_sample(5.0 * i, 100 * i) for i in range(4)]  # lag 1, 2, 3, 4 s: +0.2 s per s
    r = read_slo(Slo("lag", 5.0), window, horizon=10.0)
    assert r.value == 4.0 and r.projected == pytest.approx(6.0)
    assert not r.missed and r.at_risk and r.worst == pytest.approx(6.0)
    assert "about to be missed" in r.text()
    falling = read_slo(Slo("lag", 5.0), [_sample(5.0 * i, 100 * (3 - i)) for i in range(4)], horizon=10.0)
    assert falling.projected == falling.value == falling.worst == 1.0 and not falling.at_risk

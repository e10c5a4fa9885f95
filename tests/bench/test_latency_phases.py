"""bench/latency.py runs each rate, and the rescale phase, on a broker of its own."""

from __future__ import annotations

import argparse
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, str(ROOT / "bench"))

import latency


def _args(**over: object) -> argparse.Namespace:
    a = dict(rates=[1000, 5000, 20000], warmup=10.0, seconds=40.0, empty_seconds=20.0, rescale_rate=5000, rescale_seconds=60.0,
             parallelism=2, one_broker=False, rescales=[(2, 3)])
    a.update(over)
    return argparse.Namespace(**a)


def _names(groups: list[list[latency.Phase]]) -> list[list[str]]:
    return [[ph.name for ph in g] for g in groups]


def test_a_broker_a_measured_phase_with_the_fixed_cost_phases_first_and_the_rescale_alone() -> None:
    rescale = latency.RESCALE.format(rate=5000, p=2, to=3)
    assert _names(latency.phase_groups("keyscale", _args())) == [
        ["almost empty", "empty", "1,000/s"], ["5,000/s"], [rescale], ["20,000/s"]]
    # Spark has no live rescale
    assert _names(latency.phase_groups("spark", _args())) == [["almost empty", "empty", "1,000/s"], ["5,000/s"], ["20,000/s"]]


def test_one_broker_keeps_every_phase_in_one_run_in_order() -> None:
    groups = latency.phase_groups("keyscale", _args(one_broker=True, empty_seconds=0.0))
    assert _names(groups) == [["1,000/s", "5,000/s", latency.RESCALE.format(rate=5000, p=2, to=3), "20,000/s"]]
    assert [ph.seconds for ph in groups[0]] == [50.0, 50.0, 70.0, 50.0]


def test_each_rescale_is_a_phase_of_its_own_that_starts_at_its_first_parallelism() -> None:
    groups = latency.phase_groups("keyscale", _args(rates=[5000], empty_seconds=0.0, rescales=[(2, 3), (1, 2), (1, 1)]))
    assert _names(groups) == [["5,000/s"], [latency.RESCALE.format(rate=5000, p=2, to=3)], [latency.RESCALE.format(rate=5000, p=1, to=2)],
                              [latency.CONTROL.format(rate=5000, p=1)]]
    assert [g[0].rescale for g in groups] == [None, (2, 3), (1, 2), (1, 1)]


def test_a_rescale_from_another_parallelism_on_one_broker_is_refused() -> None:
    with pytest.raises(ValueError, match="--one-broker"):
        latency.phase_groups("keyscale", _args(one_broker=True, rescales=[(1, 2)]))


def test_rescales_are_from_to_pairs() -> None:
    assert latency.parse_rescales("", 2) == [(2, 3)]
    assert latency.parse_rescales(" 2:3, 1:2, 2:2", 2) == [(2, 3), (1, 2), (2, 2)]
    for bad in ("2", "0:1", "1:0", "a:b", "2:3,"):
        with pytest.raises(ValueError, match="FROM:TO"):
            latency.parse_rescales(bad, 2)

"""The utilisation an SLO leaves (keyscale.scaling.room): the band keeps a keeping-up batch's
latency within the SLO's headroom, leaves the load's noise under the scale-up edge, and
runs a job with an SLO hotter than 70 % where the SLO has room, through the simulator."""

from __future__ import annotations

import itertools
import math

from hypothesis import given
from hypothesis import strategies as st

from keyscale.scaling.load import Sample
from keyscale.scaling.model import AutoscalerConfig
from keyscale.scaling.policy import Autoscaler
from keyscale.scaling.room import (
    MAX_BUSY,
    MAX_PEAK_RATIO,
    MIN_BUSY,
    catch_up_given_back,
    peak_ratio,
    slo_band,
)
from keyscale.scaling.shapes import diurnal
from keyscale.scaling.simulate import simulate
from keyscale.scaling.slo import HEADROOM, Slo, parse_slo

slos = st.builds(Slo, st.sampled_from(["latency", "lag"]), st.floats(0.1, 3600.0))
slots = st.floats(0.1, 120.0)
ratios = st.floats(0.5, 5.0)


@given(slos, slots, ratios)
def test_the_band_is_ordered_and_a_valid_configuration(slo: Slo, slot: float, ratio: float) -> None:
    b = slo_band(slo, slot, ratio)
    assert 0 < b.lower <= b.target <= b.settle <= b.ceiling <= MAX_BUSY and b.ceiling >= MIN_BUSY
    cfg = b.config(AutoscalerConfig())
    assert math.isclose(cfg.scale_up_threshold, b.ceiling) and math.isclose(cfg.scale_down_threshold, b.lower)
    # The noise's peaks at the utilisation a scale-up sizes for stay under the scale-up edge.
    assert b.target * min(max(ratio, 1.0), MAX_PEAK_RATIO) <= b.ceiling + 1e-9


@given(slos, slots, ratios)
def test_a_batch_at_the_ceiling_keeps_the_slo_with_its_headroom(slo: Slo, slot: float, ratio: float) -> None:
    b = slo_band(slo, slot, ratio)
    wait = slot if slo.kind == "latency" else 0.0
    if b.ceiling > MIN_BUSY:  # the SLO leaves some room after the wait
        assert wait + b.ceiling * slot <= HEADROOM * slo.seconds + 1e-6


@given(st.sampled_from(["latency", "lag"]), st.floats(0.1, 600.0), st.floats(0.1, 600.0), slots, ratios)
def test_a_looser_slo_never_runs_the_job_cooler(kind: str, a: float, b: float, slot: float, ratio: float) -> None:
    tight, loose = sorted((a, b))
    assert slo_band(Slo(kind, tight), slot, ratio).target <= slo_band(Slo(kind, loose), slot, ratio).target  # type: ignore[arg-type]


def test_the_peak_ratio_is_the_windows_highest_rate_over_its_mean() -> None:
    w = [Sample(float(t), 5.0, r, 0, 0.0, 0.0, warmup=False) for t, r in enumerate((900.0, 1100.0, 1000.0))]
    assert math.isclose(peak_ratio(w), 1.1)
    assert peak_ratio([]) == 1.0 and peak_ratio(w[:1]) == 1.0


def test_a_tight_slo_runs_the_job_cooler_than_a_loose_one_would() -> None:
    # 10 s with a 5 s trigger: 0.95 x 10 - 5 s of the slot left for the batch, 90 %.
    assert math.isclose(slo_band(Slo("latency", 10.0), 5.0, 1.0).ceiling, 0.9)
    # 7 s: 1.65 s of 5 s, 33 %: more subtasks than the usual 70 % target would give.
    assert math.isclose(slo_band(Slo("latency", 7.0), 5.0, 1.0).ceiling, 0.33)


def test_with_an_slo_with_room_a_diurnal_day_costs_fewer_cores_at_no_more_rescales() -> None:
    """Compressed diurnal day, ±10 % noise, latency=10s: sized for the SLO's room it holds
    fewer cores than the 70 % target of the policy without an SLO, keeps every batch within
    the SLO, and rescales no more often (no scale-up right after a scale-down)."""
    trace = diurnal()
    slo = simulate(trace, policy=Autoscaler(AutoscalerConfig(), slo=parse_slo("latency=10s")))
    plain = simulate(trace, policy=Autoscaler(AutoscalerConfig()))
    assert slo.core_seconds < 0.97 * plain.core_seconds
    assert all(b.metrics.latency is None or b.metrics.latency.p99_seconds <= 10.0 for b in slo.batches)
    assert len(slo.changes) <= len(plain.changes)
    actions = [d.action for d in slo.changes]
    assert not any(a == "scale_down" and b == "scale_up" for a, b in itertools.pairwise(actions))


def test_catch_up_capacity_is_given_back_once_the_backlog_is_worked_off() -> None:
    assert catch_up_given_back(True, 0.0, True) is not None
    # Not while a backlog is left, the SLO is not met, or the scale-up was for the input alone.
    assert catch_up_given_back(True, 1.0, True) is None
    assert catch_up_given_back(True, 0.0, False) is None
    assert catch_up_given_back(False, 0.0, True) is None


def test_a_10x_spike_is_measured_in_full_and_its_catch_up_given_back() -> None:
    """The spike's first batch reads 4x its base rate (its read limit) while 10x arrives: the
    backlog's growth counts as input, so the scale-up covers the spike and its backlog at
    once, and what was for the backlog goes as soon as it is worked off, not a delay later."""
    from keyscale.scaling.shapes import spike_10x

    r = simulate(spike_10x(), policy=Autoscaler(AutoscalerConfig(), slo=parse_slo("latency=10s")))
    up = r.changes[0]
    assert up.action == "scale_up" and up.inputs["input_rate"] == 20_000.0
    over = [b for b in r.batches if b.metrics.latency and b.metrics.latency.p99_seconds > 10.0]
    assert len(over) <= 2
    back = r.changes[1]
    assert back.action == "scale_down" and "now worked off" in back.reason
    assert back.time - up.time < AutoscalerConfig().scale_down_delay_seconds + AutoscalerConfig().stabilization_seconds

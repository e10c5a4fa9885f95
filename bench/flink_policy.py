"""``keyscale run`` with Flink's operator autoscaler in place of keyscale's, recommending only:
the job of ``bench/autoscale.py --real``'s ``flink`` policy, whose rescales the benchmark
itself makes as Flink's operator does, by a restart (stop with a savepoint, start again at
the new parallelism: ``autoscale_real.py``, ``run_policy``).

    python bench/flink_policy.py run JOBFILE --job-dir DIR ... --scaling auto --autoscaler recommend

The policy is :class:`keyscale.scaling.flink.FlinkAutoscaler` (its documented algorithm) with
its windows compressed as the benchmark compresses keyscale's (:data:`CONFIG`: the same
metrics window, stabilisation, scale-down delay and catch-up as ``bench/elastic.py``'s
``AUTOSCALER_OPTIONS``; a reconcile every 2 s): a 220 s trace is over before Flink's
defaults (5 min of stabilisation, a 15 min window) would decide anything. Its decisions are
the job's autoscaler events, as keyscale's are in recommend mode. A benchmark's tool, not
a keyscale feature: it swaps the policy by patching ``make_autoscaler`` before the CLI runs.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from keyscale.runtime.batch import parallelism
from keyscale.scaling.flink import FlinkAutoscaler, FlinkConfig

#: Flink's defaults with its time scale compressed to the benchmark's (bench/elastic.py's
#: AUTOSCALER_OPTIONS for keyscale): window 8 s, stabilisation 5 s, scale-down after 10 s,
#: catch-up 20 s; restart.time the restart this benchmark measured (about 20 s).
CONFIG = FlinkConfig(metrics_window_seconds=8.0, stabilization_seconds=5.0, scale_down_interval_seconds=10.0,
                     catch_up_seconds=20.0, restart_seconds=20.0, backlog_lag_threshold_seconds=10.0,
                     reconcile_seconds=2.0, max_parallelism=4)


class FlinkInKeyscale:
    """What the job's run loop asks of its autoscaler, answered by Flink's policy."""

    slo = None  # Flink's has none: the status shows no SLO

    def __init__(self, config: FlinkConfig) -> None:
        self.policy = FlinkAutoscaler(config)
        self.dirty: set[str] = set()  # no rate history to save
        self.histories: dict[str, Any] = {}

    def observe(self, m: Any) -> Any:
        return self.policy.observe(m)


_KEYSCALES = parallelism.make_autoscaler


def _flink(opts: Any, jobdir: Any) -> Any:
    if _KEYSCALES(opts, jobdir) is None:  # keyscale's own checks of the options: --scaling auto, a mode
        return None
    return FlinkInKeyscale(CONFIG)


parallelism.make_autoscaler = _flink  # the runner calls it through the module, after this

if __name__ == "__main__":
    from keyscale.cli.main import main

    sys.exit(main(sys.argv[1:]))

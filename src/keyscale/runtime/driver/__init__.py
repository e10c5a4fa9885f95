"""Driver side, the whole run: set-up, the run loop, recovery.

:class:`.runner.JobRunner` loads the job (:mod:`.jobfile`, :mod:`.jobargs`, :mod:`.shipping`),
opens the Spark session (:mod:`.session`), recovers (:mod:`.recovery`), keeps its heartbeat
(:mod:`.heartbeat`) and runs batches through :mod:`keyscale.runtime.batch`. Imports the
floors below (batch, task), never the control plane above: what serves the job while it
runs is handed to the runner (``serve``).
"""

"""Driver side, facing users: starting a job and controlling it while it runs.

:func:`.handle.start_job` and :class:`.handle.JobHandle` (the Python API), :mod:`.submit`
(``keyscale.main``), the HTTP control API (:mod:`.server`, :mod:`.auth`, :mod:`.settings`),
Prometheus metrics (:mod:`.metrics`) and what a job directory says without the job
(:mod:`.jobstatus`).
"""

"""Driver side, facing users: starting a job and controlling it while it runs.

:func:`.handle.start_job` and :class:`.handle.JobHandle` (the Python API), :mod:`.submit`
(``keyscale.main``), the HTTP control API (:mod:`.server`, :mod:`.auth`, :mod:`.settings`),
Prometheus metrics (:mod:`.metrics`) and what a job directory says without the job
(:mod:`.jobstatus`); the control API's ``GET /state`` in a process of its own, with no job
in it (:mod:`.lookups`, ``keyscale state serve``). The top floor of the runtime: a running job is seen only through
:class:`.running.RunningJob`; :func:`.handle.start_job` alone names the runner, to build one.
Nothing below (driver, batch, task) imports this package.
"""

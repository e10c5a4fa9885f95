"""Driver side, one batch at a time: the commit protocol.

:func:`.commit.run_batch` is the protocol as a list of steps; around it: the source plan
(:mod:`.source_plan`), parallelism changes between batches (:mod:`.parallelism`), the
stages a batch runs (:mod:`.stages`), poison batches (:mod:`.poison`), the job's state the
steps read and write (:mod:`.jobstate`, each part naming who writes it), what the job
tells (:mod:`.status`), and the checks on Spark file sources (:mod:`.malformed`,
:mod:`.spark_source`). Imports the job graph (``keyscale._steps``) and :mod:`keyscale.runtime.task`,
never the driver or the control plane.
"""

"""A user's own script: their SparkSession and settings, a keyscale job started from Python,
rescaled, savepointed and stopped from Python. Prints what the test checks, as JSON."""

import json
import sys
import time
from pathlib import Path

from pyspark.sql import SparkSession

import keyscale as ks

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from conftest import write_events

work = Path(sys.argv[1])
spark = (SparkSession.builder.master("local[2]").appName("my-own-app")
         .config("spark.sql.shuffle.partitions", "7").config("spark.sql.session.timeZone", "Europe/Paris").getOrCreate())
inp, out = work / "in", work / "out"
write_events(inp, files=1, rows=2000, keys=50)

events = spark.readStream.schema("key string, value long, ts timestamp").option("maxFilesPerTrigger", 1).parquet(str(inp))
job = (ks.stream(events).key_by("key")
       .aggregate(uid="totals", count=ks.aggregates.count(), total=ks.aggregates.sum("value"))
       .sink(ks.sinks.ParquetSink(str(out)))
       .start(job_dir=str(work / "job"), parallelism=2, trigger_interval="200 milliseconds"))


def wait_for(pred, what, timeout=120):
    deadline = time.monotonic() + timeout
    while not pred():
        if not job.is_active or time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}: {job.status()}")
        time.sleep(0.2)


wait_for(lambda: job.status()["last_checkpoint"] == 0, "batch 0")
job.rescale(3)
pending = job.status()["pending_rescale"]
write_events(inp, files=1, rows=2000, keys=50, first=1)
wait_for(lambda: job.status()["last_checkpoint"] == 1, "batch 1")
after = job.status()
savepoint = job.savepoint()
write_events(inp, files=1, rows=2000, keys=50, first=2)
wait_for(lambda: job.status()["last_checkpoint"] == 2, "batch 2")
final_savepoint = job.stop(savepoint=True)
print("RESULT " + json.dumps({
    "pending": pending, "after": {"state": after["state"], "pending": after["pending_rescale"],
                                  "parallelism": after["operators"]["totals"]["parallelism"]},
    "savepoint": savepoint, "final_savepoint": final_savepoint, "final_state": job.status()["state"],
    "conf": {k: spark.conf.get(k) for k in ("spark.sql.shuffle.partitions", "spark.sql.session.timeZone", "spark.app.name")},
    "ui": spark.sparkContext.uiWebUrl is not None,
    "batches": [b.parallelism for b in job.summary.batches],
}))
spark.stop()

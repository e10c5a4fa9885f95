"""Per-user sessions from a Kafka topic into a Delta Lake table, exactly once.

    keyscale run examples/kafka_sessions_delta.py --job-dir jobs/ksd -p 2 \
        --set bootstrap=HOST:PORT --set input=clicks --set output=/data/sessions [--set gap="30 seconds"]

Input: a topic of JSON values {"key": user, "value": ..., "ts": event time}. A session is a
run of a user's events with gaps shorter than ``gap``; it closes when the watermark passes
its last event plus the gap (a partition with no records for ``idleness`` stops holding
the watermark back) and becomes one row (key, window_start, window_end, events, total) of
the Delta table, appended in one table commit per batch that carries the job's id and the
batch: a batch replayed after a crash is recognised by the table and not written twice.
``output`` may be a local path or ``s3://bucket/path``.
"""

import keyscale as ks

NAME = "kafka_sessions_delta"


def build(ctx: ks.JobContext) -> ks.Pipeline:
    clicks = ks.kafka.kafka_source(
        ctx.arg("bootstrap"), ctx.arg("input"), uid="clicks",
        decoder=ks.kafka.json_values("key string, value long, ts timestamp"),
        max_records_per_batch=int(ctx.arg("max_records", "100000")),
    )
    return (
        ks.stream(clicks)
        .with_watermark("ts", ctx.arg("out_of_orderness", "5 seconds"), idleness=ctx.args.get("idleness"))
        .key_by("key")
        .window(ks.windows.SessionWindows(ctx.arg("gap", "30 seconds")))
        .aggregate(uid="sessions", events=ks.aggregates.count(), total=ks.aggregates.sum("value"))
        .sink(ks.sinks.DeltaSink(ctx.arg("output")))
    )


if __name__ == "__main__":
    raise SystemExit(ks.main(build))

"""Running count and sum per key, Kafka in and Kafka out, exactly once.

    keyscale run examples/kafka_running_count.py --job-dir jobs/krc -p 2 \
        --set bootstrap=HOST:PORT --set input=events --set output=counts

Input: a topic of JSON values {"key": ..., "value": ..., "ts": ...}. For each key updated
in a batch, a record keyed by the key with value {"key", "count", "sum"} goes to the output
topic, in one Kafka transaction per output task; read it with
``isolation.level=read_committed``. The input offsets are keyscale's state: rescale the job
(``keyscale rescale``) and its readers split or merge the topic's partitions.
"""

import keyscale as ks

NAME = "kafka_running_count"


def build(ctx: ks.JobContext) -> ks.Pipeline:
    bootstrap = ctx.arg("bootstrap")
    events = ks.kafka.kafka_source(
        bootstrap, ctx.arg("input"), uid="events",
        decoder=ks.kafka.json_values("key string, value long, ts timestamp"),
        max_records_per_batch=int(ctx.arg("max_records", "100000")),
        commit_group=ctx.args.get("group"),  # positions also in this consumer group, for lag monitors
    )
    return (
        ks.stream(events)
        .key_by("key")
        .aggregate(uid="totals", count=ks.aggregates.count(), sum=ks.aggregates.sum("value"))
        .sink(ks.kafka.KafkaSink(bootstrap, ctx.arg("output"), key="key"))
    )


if __name__ == "__main__":
    raise SystemExit(ks.main(build))

"""The stateless floor of ``examples/kafka_running_count.py``: the same Kafka source and
``KafkaSink`` (exactly once), no keyed stage; each input record becomes one output record
``{"key", "seq"}`` (bench/latency.py, issue 35).

    keyscale run bench/jobs/kafka_passthrough.py --job-dir jobs/kp -p 2 \
        --set bootstrap=HOST:PORT --set input=events --set output=rows
"""

import keyscale as ks

NAME = "kafka_passthrough"


def build(ctx: ks.JobContext) -> ks.Pipeline:
    bootstrap = ctx.arg("bootstrap")
    events = ks.kafka.kafka_source(
        bootstrap, ctx.arg("input"), uid="events",
        decoder=ks.kafka.json_values("key string, value long, seq long"),
        max_records_per_batch=int(ctx.arg("max_records", "100000")),
    )
    return ks.stream(events).select("key", "seq").sink(ks.kafka.KafkaSink(bootstrap, ctx.arg("output"), key="key"))

"""Running count and sum per key over a partitioned log (a local folder or Redis streams).

    keyscale log create LOG --partitions 4 --schema "key string, value long, ts timestamp"
    keyscale generate LOG --schedule "2000/s for 30s" --keys 1000 &
    keyscale run examples/log_count.py --job-dir jobs/lc -p 2 --set log=LOG --set output=OUT

The readers' offsets are the source's operator state: ``keyscale rescale jobs/lc -p 1``
gives one reader every partition, ``-p 4`` one each; partitions added with
``keyscale log add-partitions LOG 2`` are picked up at the next batch. ``keyscale status``
shows each reader's partitions, offsets and lag.
"""

import keyscale as ks

NAME = "log_count"


def build(ctx: ks.JobContext) -> ks.Pipeline:
    limit = ctx.args.get("max_records_per_batch")
    source = ks.sources.log_source(ctx.arg("log"), uid="reader", max_records_per_batch=int(limit) if limit else None)
    return (
        ks.stream(source)
        .key_by("key")
        .aggregate(uid="totals", count=ks.aggregates.count(), sum=ks.aggregates.sum("value"))
        .sink(ks.sinks.ParquetSink(ctx.arg("output")))
    )

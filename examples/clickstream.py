"""One stream of page views, two outputs: a branching pipeline (``ks.pipeline``).

    keyscale run examples/clickstream.py --job-dir jobs/clicks -p 2 --until-idle --drain-at-end \
        --set input=DIR --set sessions=OUT1 --set pages=OUT2

Input columns: user string, page string, ts timestamp (event time). Sessions per user (a
run of views with gaps shorter than ``gap``, default 30 seconds) go to ``sessions`` as
(user, window_start, window_end, views) once the watermark closes them; running view
counts per page go to ``pages`` as (page, views) for each page viewed in a batch. A batch
reads its input once; each output gets the batch exactly once, and each stage's state
rescales on its own.
"""

import keyscale as ks

NAME = "clickstream"


def build(ctx: ks.JobContext) -> ks.Pipeline:
    views = (
        ctx.spark.readStream.schema("user string, page string, ts timestamp")
        .option("maxFilesPerTrigger", int(ctx.arg("files_per_batch", "1")))
        .parquet(ctx.arg("input"))
    )
    events = ks.stream(views).with_watermark("ts", ctx.arg("out_of_orderness", "10 seconds"))
    sessions = events.key_by("user").window(ks.windows.SessionWindows(ctx.arg("gap", "30 seconds"))).aggregate(uid="sessions", views=ks.aggregates.count())
    pages = events.key_by("page").aggregate(uid="page_views", views=ks.aggregates.count())
    return ks.pipeline(
        sessions.sink(ks.sinks.ParquetSink(ctx.arg("sessions"))),
        pages.sink(ks.sinks.ParquetSink(ctx.arg("pages"))),
    )


if __name__ == "__main__":  # spark-submit examples/clickstream.py --job-dir DIR -p 2 --set input=... --set sessions=... --set pages=...
    raise SystemExit(ks.main(build))

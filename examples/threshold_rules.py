"""Per-key thresholds that change at run time: a rules stream as broadcast state.

    keyscale log create EVENTS --partitions 4 --schema "key string, value long"
    keyscale log create RULES --partitions 1 --schema "key string, threshold long"
    keyscale run examples/threshold_rules.py --job-dir jobs/rules -p 2 \
        --set events=EVENTS --set rules=RULES --set output=OUT

Each rules record sets the threshold of a key (default ``default_threshold``, 100). Every
subtask of the keyed stage reads the same rules (broadcast state); the rules records of a
batch apply before that batch's events. For every event the stage emits
(key, total so far, threshold in force, alert, rules version seen).
"""

import keyscale as ks

NAME = "threshold_rules"


def set_rule(state, row):
    """Runs on the driver for each rules record, in log order."""
    state[row.key] = row.threshold
    state["__version"] = state.get("__version", 0) + 1


class Alerts(ks.KeyedProcessFunction):
    def __init__(self, default: int):
        self.default = default

    def open(self, ctx):
        self.total = ctx.value_state("total", "long")

    def process_element(self, row, ctx):
        rules = ctx.broadcast_state
        threshold = rules.get(ctx.key, self.default)
        before = self.total.value() or 0
        total = before + row.value
        self.total.update(total)
        yield (ctx.key, total, threshold, before < threshold <= total, rules.get("__version", 0))


def build(ctx: ks.JobContext) -> ks.Pipeline:
    rules = ks.sources.broadcast(ks.sources.log_source(ctx.arg("rules"), uid="rules"), set_rule)
    limit = ctx.args.get("max_records_per_batch")
    events = ks.sources.log_source(ctx.arg("events"), uid="events", max_records_per_batch=int(limit) if limit else None)
    return (
        ks.stream(events)
        .key_by("key")
        .process(Alerts(int(ctx.arg("default_threshold", "100"))), "key string, total long, threshold long, alert boolean, version long",
                 uid="alerts", broadcast=rules)
        .sink(ks.sinks.ParquetSink(ctx.arg("output")))
    )

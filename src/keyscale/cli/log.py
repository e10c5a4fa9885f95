"""The log commands: ``keyscale log create|produce|add-partitions|describe|generate`` and ``keyscale generate``.

``LOG`` is a folder (or ``file:///folder``) or ``redis://host:port/db?name=NAME`` (see
:mod:`keyscale.sources.log`)::

    keyscale log create LOG --partitions N [--schema "key string, value long, ts timestamp"]
    keyscale log produce LOG --file rows.jsonl|rows.csv|rows.parquet [--key COL]...
    keyscale log add-partitions LOG N
    keyscale log describe LOG [--json]
    keyscale generate LOG --schedule "2000/s for 30s, 20000/s for 60s" [--keys N] [--partitions N]

``keyscale``'s parser registers them with :func:`add_log_parsers`; each handler returns an
exit code and raises :class:`~keyscale.errors.KeyscaleError` for what the user can fix.

>>> import argparse
>>> p = argparse.ArgumentParser(prog="keyscale")
>>> _ = add_log_parsers(p.add_subparsers(dest="command"))
>>> a = p.parse_args(["log", "add-partitions", "events", "2"])
>>> a.func is cmd_add_partitions, a.n
(True, 2)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa

from keyscale.errors import InputDataError
from keyscale.sources.generator import GENERATOR_DDL, RateSchedule, generate
from keyscale.sources.log import LogWriter, create_log, open_log
from keyscale.sources.partitioned import LogError, PartitionedLog
from keyscale.state.types import arrow_schema

__all__ = [
    "add_log_parsers",
    "cmd_add_partitions",
    "cmd_create",
    "cmd_describe",
    "cmd_generate",
    "cmd_produce",
    "read_rows",
]

_LOG_HELP = "a folder, file:///folder, or redis://host:port/db?name=NAME"


def add_log_parsers(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``log ...`` and ``generate`` on ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    lp: argparse.ArgumentParser = subparsers.add_parser("log", help="partitioned logs: create, produce to, grow, describe")
    lsub = lp.add_subparsers(dest="log_command", required=True)

    c = lsub.add_parser("create", help="create an empty log")
    c.add_argument("log", metavar="LOG", help=_LOG_HELP)
    c.add_argument("--partitions", type=int, required=True, metavar="N")
    c.add_argument("--schema", default=GENERATOR_DDL, metavar="DDL",
                   help=f"the records' columns in Spark DDL (default: the generator's, {GENERATOR_DDL!r})")
    c.set_defaults(func=cmd_create)

    pr = lsub.add_parser("produce", help="append the rows of a file (.jsonl, .csv or .parquet)")
    pr.add_argument("log", metavar="LOG", help=_LOG_HELP)
    pr.add_argument("--file", required=True, help="rows.jsonl (one JSON object a line), rows.csv (with a header) or rows.parquet")
    pr.add_argument("--key", action="append", default=[], metavar="COL",
                    help="partition rows by a hash of this column (repeat, or comma-separate, for several); default: all to one partition, round-robin")
    pr.set_defaults(func=cmd_produce)

    ap = lsub.add_parser("add-partitions", help="add N empty partitions (readers and writers may keep running)")
    ap.add_argument("log", metavar="LOG", help=_LOG_HELP)
    ap.add_argument("n", type=int, metavar="N", help="how many partitions to add")
    ap.set_defaults(func=cmd_add_partitions)

    d = lsub.add_parser("describe", help="schema, partitions and end offsets")
    d.add_argument("log", metavar="LOG", help=_LOG_HELP)
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_describe)

    _add_generate(lsub.add_parser("generate", help="write records at a scheduled rate (same as `keyscale generate`)"))
    _add_generate(subparsers.add_parser("generate", help="write records to a log at a scheduled rate (load for demos and benchmarks)"))
    return lp


def _add_generate(g: argparse.ArgumentParser) -> None:
    g.add_argument("log", metavar="LOG", help=_LOG_HELP)
    g.add_argument("--schedule", required=True, help="e.g. '2000/s for 30s, 20000/s for 60s, 2000/s to 500/s for 1m'")
    g.add_argument("--keys", type=int, default=100, metavar="N", help="number of distinct keys k0..k<N-1> (default 100)")
    g.add_argument("--partitions", type=int, metavar="N",
                   help=f"create the log with N partitions and the generator's schema ({GENERATOR_DDL}) if it does not exist")
    g.add_argument("--tick", type=float, default=0.1, metavar="SECONDS", help="append what is due this often (default 0.1)")
    g.add_argument("--start-time", type=float, metavar="EPOCH_SECONDS", help="event time of the schedule's start (default: now)")
    g.add_argument("--seed", type=int, default=0, help="varies keys and values (default 0)")
    g.set_defaults(func=cmd_generate)


def cmd_create(a: argparse.Namespace) -> int:
    """``keyscale log create``."""
    log = create_log(a.log, arrow_schema(a.schema), a.partitions)
    print(f"keyscale: created log {log.uri} with {a.partitions} partitions ({a.schema})")
    return 0


def read_rows(path: str | Path, schema: pa.Schema) -> pa.Table:
    """Rows of a .jsonl/.json, .csv or .parquet file, converted to ``schema`` (columns named by it).

    JSON and CSV values are parsed as the schema's types; timestamps are ISO 8601 text, UTC
    unless they carry a zone offset.
    Raises :class:`~keyscale.errors.InputDataError` naming the file.
    """
    import pyarrow.csv as pacsv
    import pyarrow.json as pajson
    import pyarrow.parquet as pq

    p = Path(path)
    if not p.is_file():
        raise InputDataError(f"{p} is not a file")
    suffix = p.suffix.lower()
    if suffix not in (".jsonl", ".json", ".ndjson", ".csv", ".parquet"):
        raise InputDataError(f"{p}: unknown file type {suffix or '(none)'!r}; use .jsonl, .csv or .parquet")

    def read(s: pa.Schema) -> pa.Table:
        if suffix == ".parquet":
            return pq.read_table(p)
        if suffix == ".csv":
            conv = pacsv.ConvertOptions(column_types={f.name: f.type for f in s}, strings_can_be_null=True)
            return pacsv.read_csv(p, convert_options=conv)
        opts = pajson.ParseOptions(explicit_schema=s, unexpected_field_behavior="error")
        return pajson.read_json(p, parse_options=opts)

    # Timestamps with a zone offset parse as the schema's type; those without are UTC.
    naive = pa.schema([pa.field(f.name, pa.timestamp(f.type.unit)) if pa.types.is_timestamp(f.type) and f.type.tz else f for f in schema])
    try:
        return read(schema)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError) as e:
        first = e
    if not naive.equals(schema):
        try:
            return read(naive)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OSError):
            pass
    msg = str(first).strip().splitlines()[0] if str(first).strip() else type(first).__name__
    raise InputDataError(f"{p}: {msg}") from None


def cmd_produce(a: argparse.Namespace) -> int:
    """``keyscale log produce``."""
    log = open_log(a.log)
    keys = [k.strip() for item in a.key for k in item.split(",") if k.strip()]
    table = read_rows(a.file, log.schema)
    ranges = LogWriter(log, key_columns=keys or None).write(table)
    where = ", ".join(f"{p}: {s}-{e}" for p, (s, e) in sorted(ranges.items())) or "nothing"
    print(f"keyscale: appended {table.num_rows:,} records to {log.uri} (partition: offsets {where})")
    return 0


def cmd_add_partitions(a: argparse.Namespace) -> int:
    """``keyscale log add-partitions``."""
    if a.n < 1:
        raise LogError(f"add-partitions takes a number of partitions to add (>= 1), not {a.n}")
    log = open_log(a.log)
    old = log.num_partitions()
    new = log.add_partitions(a.n)
    print(f"keyscale: log {log.uri} now has {new} partitions (was {old})")
    return 0


def describe_dict(log: PartitionedLog) -> dict[str, Any]:
    """What ``keyscale log describe --json`` prints."""
    ends = log.end_offsets()
    return {
        "uri": log.uri,
        "schema": [{"name": f.name, "type": str(f.type)} for f in log.schema],
        "partitions": len(ends),
        "end_offsets": ends,
        "records": sum(ends),
    }


def cmd_describe(a: argparse.Namespace) -> int:
    """``keyscale log describe``."""
    log = open_log(a.log)
    if a.json:
        print(json.dumps(describe_dict(log), indent=1))
    else:
        print(log.describe())
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    """``keyscale generate`` / ``keyscale log generate``."""
    schedule = RateSchedule.parse(a.schedule)
    if a.partitions is not None:
        try:
            log = open_log(a.log)
        except LogError:
            log = create_log(a.log, GENERATOR_DDL, a.partitions)
            print(f"keyscale: created log {log.uri} with {a.partitions} partitions ({GENERATOR_DDL})", file=sys.stderr)
    else:
        log = open_log(a.log)
    try:
        r = generate(log, schedule, keys=a.keys, start_time=a.start_time, tick=a.tick, seed=a.seed)
    except KeyboardInterrupt:
        print("keyscale: generate interrupted", file=sys.stderr)
        return 130
    print(f"keyscale: generated {r.records:,} records into {log.uri} in {r.seconds:.1f} s (start time {r.start_time_ms} ms)")
    return 0

"""`keyscale log ...` and `keyscale generate`, through keyscale.cli.main.main."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from keyscale.cli.main import main
from keyscale.sources import RateSchedule, generated_records, open_log, partition_of


def test_create_produce_grow_describe_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log_dir = str(tmp_path / "events")
    assert main(["log", "create", log_dir, "--partitions", "2", "--schema", "key string, value long, ts timestamp"]) == 0
    assert "created log" in capsys.readouterr().out

    jsonl = tmp_path / "rows.jsonl"
    jsonl.write_text(
        '{"key": "a", "value": 1, "ts": "2026-01-01T00:00:00"}\n'
        '{"key": "b", "value": 2, "ts": "2026-01-01T00:00:01.5"}\n'
        '{"key": "a", "value": null, "ts": null}\n'
    )
    assert main(["log", "produce", log_dir, "--file", str(jsonl), "--key", "key"]) == 0
    assert "appended 3 records" in capsys.readouterr().out

    csv = tmp_path / "rows.csv"
    csv.write_text("key,value,ts\nc,3,2026-01-02 10:00:00\nd,,2026-01-02 10:00:01\n")
    assert main(["log", "produce", log_dir, "--file", str(csv)]) == 0  # no key: one partition, round-robin
    pq_file = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"value": [4], "key": ["e"], "ts": pa.array([dt.datetime(2026, 1, 3)], pa.timestamp("ms"))}), pq_file)
    assert main(["log", "produce", log_dir, "--file", str(pq_file), "--key", "key"]) == 0
    capsys.readouterr()

    log = open_log(log_dir)
    ends = log.end_offsets()
    assert sum(ends) == 6
    rows = sorted(((r["key"], r["value"], r["ts"]) for p, e in enumerate(ends) for r in log.read(p, 0, e).to_pylist()), key=repr)
    utc = dt.UTC
    assert rows == [
        ("a", 1, dt.datetime(2026, 1, 1, tzinfo=utc)),
        ("a", None, None),
        ("b", 2, dt.datetime(2026, 1, 1, 0, 0, 1, 500000, tzinfo=utc)),
        ("c", 3, dt.datetime(2026, 1, 2, 10, tzinfo=utc)),
        ("d", None, dt.datetime(2026, 1, 2, 10, 0, 1, tzinfo=utc)),
        ("e", 4, dt.datetime(2026, 1, 3, tzinfo=utc)),
    ]
    a_rows = [p for p, e in enumerate(ends) for r in log.read(p, 0, e).to_pylist() if r["key"] == "a"]
    assert len(set(a_rows)) == 1 and a_rows[0] == partition_of(pa.table({"key": ["a"]}), ["key"], 2)[0]

    assert main(["log", "add-partitions", log_dir, "3"]) == 0
    assert "now has 5 partitions (was 2)" in capsys.readouterr().out
    assert main(["log", "describe", log_dir]) == 0
    out = capsys.readouterr().out
    assert "5 partitions, 6 records" in out and "partition 4: end offset 0" in out
    assert main(["log", "describe", log_dir, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["partitions"] == 5 and d["records"] == 6 and d["end_offsets"][2:] == [0, 0, 0]
    assert [c["name"] for c in d["schema"]] == ["key", "value", "ts"]


def test_errors_are_one_line_and_exit_non_zero(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    def err(argv: list[str]) -> str:
        code = main(argv)
        assert code != 0
        text = capsys.readouterr().err.strip()
        assert text.startswith("keyscale: error: ") and "\n" not in text, text
        return text

    missing = str(tmp_path / "missing")
    assert "does not exist" in err(["log", "describe", missing])
    log_dir = str(tmp_path / "l")
    assert main(["log", "create", log_dir, "--partitions", "1", "--schema", "key string, value long"]) == 0
    assert "already a log" in err(["log", "create", log_dir, "--partitions", "1"])
    assert "unknown type" in err(["log", "create", str(tmp_path / "x"), "--partitions", "1", "--schema", "a strang"])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"key": "a", "value": "not a number"}\n')
    assert "bad.jsonl" in err(["log", "produce", log_dir, "--file", str(bad)])
    extra = tmp_path / "extra.jsonl"
    extra.write_text('{"key": "a", "value": 1, "colour": "red"}\n')
    assert "extra.jsonl" in err(["log", "produce", log_dir, "--file", str(extra)])
    short = tmp_path / "short.csv"
    short.write_text("key\na\n")
    assert "no column 'value'" in err(["log", "produce", log_dir, "--file", str(short)])
    (tmp_path / "rows.txt").write_text("x")
    assert "unknown file type '.txt'" in err(["log", "produce", log_dir, "--file", str(tmp_path / "rows.txt")])
    assert "key column 'user'" in err(["log", "produce", log_dir, "--file", str(short), "--key", "user"])
    assert "add-partitions takes" in err(["log", "add-partitions", log_dir, "0"])
    assert "is not NUMBER/UNIT" in err(["generate", log_dir, "--schedule", "lots for 1s"])
    assert "cannot reach Redis at 127.0.0.1:1" in err(["generate", "redis://127.0.0.1:1/0?name=x", "--schedule", "1/s for 1s"])
    assert open_log(log_dir).end_offsets() == [0]


def test_generate_creates_the_log_and_writes_the_schedule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log_dir = str(tmp_path / "gen")
    argv = ["generate", log_dir, "--schedule", "400/s for 0.5s, 100/s for 0.5s", "--keys", "4", "--partitions", "2", "--start-time", "1000", "--tick", "0.05"]
    assert main(argv) == 0
    assert "generated 250 records" in capsys.readouterr().out
    log = open_log(log_dir)
    ends = log.end_offsets()
    got = pa.concat_tables([log.read(p, 0, e) for p, e in enumerate(ends)]).sort_by("seq")
    sched = RateSchedule.parse("400/s for 0.5s, 100/s for 0.5s")
    assert got.equals(generated_records(sched, 0, 250, keys=4, start_time_ms=1_000_000).select(log.schema.names))
    # `keyscale log generate` is the same command, on the existing log
    assert main(["log", "generate", log_dir, "--schedule", "100/s for 0.1s", "--keys", "4"]) == 0
    assert sum(log.end_offsets()) == 260


def test_generate_in_a_subprocess_into_redis(redis_url: str, tmp_path: Path) -> None:
    uri = f"{redis_url}?name=cli-gen"
    proc = subprocess.run(
        [sys.executable, "-m", "keyscale.cli.main", "generate", uri, "--schedule", "1000/s for 0.3s", "--keys", "3", "--partitions", "3"],
        capture_output=True, text=True, timeout=120, env={**os.environ},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "generated 300 records" in proc.stdout
    assert "generate: done: 300 records written" in proc.stderr  # progress goes to the keyscale logger
    assert main(["log", "describe", uri]) == 0
    log = open_log(uri)
    assert log.num_partitions() == 3 and sum(log.end_offsets()) == 300

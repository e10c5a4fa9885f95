"""A batch's intent crosses a crash boundary (one run writes it, the next replays it, maybe
a newer keyscale): BatchIntent's wire form round-trips, reads what older keyscale wrote,
and refuses a later version by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from keyscale.checkpoint.intent import INTENT_VERSION, BatchIntent, source_plan
from keyscale.checkpoint.jobdir import JobDir
from keyscale.errors import StateError

uids = st.text(st.characters(min_codepoint=33, max_codepoint=0x2FFF), min_size=1, max_size=8)
offsets = st.integers(0, 2**62)
plans = st.lists(st.lists(st.tuples(st.integers(0, 10_000), offsets, offsets), max_size=4), max_size=4).map(source_plan)
intents = st.builds(
    BatchIntent,
    batch_time_ms=st.integers(0, 2**53),
    parallelism=st.dictionaries(uids, st.integers(1, 32_768), max_size=5),
    watermark_ms=st.none() | st.integers(-(2**63), 2**63 - 1),
    drain=st.booleans(),
    source_plan=st.none() | plans,
    side_plan=st.none() | plans,
    broadcast_plans=st.dictionaries(uids, plans, max_size=3),
    log_ids=st.dictionaries(uids, st.none() | st.text(max_size=40), max_size=3),
    replanned_from=st.none() | st.dictionaries(uids, st.integers(1, 32_768), max_size=3),
    epoch=st.integers(0, 10_000),
)


@settings(max_examples=300, deadline=None)
@given(intents)
def test_an_intent_survives_its_wire_form_and_json(intent: BatchIntent) -> None:
    assert BatchIntent.from_wire(intent.to_wire()) == intent
    assert BatchIntent.from_wire(json.loads(json.dumps(intent.to_wire()))) == intent  # as the file holds it
    assert intent.to_wire()["v"] == INTENT_VERSION


# An intent as keyscale wrote it before the version was recorded: a log source's batch from
# a chaos run's job directory (bench/chaos.py), verbatim.
TODAYS_LOG_SOURCE_INTENT = """{
 "batch_time_ms": 1795862048830,
 "broadcast_plans": {},
 "epoch": 7,
 "log_ids": {
  "reader": "d42ddf9031634ff2ab57d65e2b884d04"
 },
 "parallelism": {
  "reader": 4,
  "seq": 4,
  "windows": 4
 },
 "source_plan": [[[0, 17863, 18095]], [[1, 8865, 8945]], [[2, 8975, 9089]], [[3, 8990, 9113]]],
 "watermark_ms": 1795862040963
}"""


def test_todays_intent_files_are_version_1() -> None:
    intent = BatchIntent.from_wire(json.loads(TODAYS_LOG_SOURCE_INTENT))
    assert intent == BatchIntent(
        batch_time_ms=1795862048830, parallelism={"reader": 4, "seq": 4, "windows": 4}, watermark_ms=1795862040963,
        source_plan=(((0, 17863, 18095),), ((1, 8865, 8945),), ((2, 8975, 9089),), ((3, 8990, 9113),)),
        log_ids={"reader": "d42ddf9031634ff2ab57d65e2b884d04"}, epoch=7,
    )
    # Written again, it is the same object plus its version.
    assert intent.to_wire() == {**json.loads(TODAYS_LOG_SOURCE_INTENT), "v": 1}


def test_older_intents_without_the_later_keys_still_read() -> None:
    """A Spark source's intent from before epochs, rules streams and log ids; a drain's; a re-planned one."""
    assert BatchIntent.from_wire({"batch_time_ms": 5, "parallelism": {"totals": 2}}) == BatchIntent(batch_time_ms=5, parallelism={"totals": 2})
    drain = BatchIntent.from_wire({"batch_time_ms": 5, "parallelism": {"totals": 2}, "watermark_ms": 2**63 - 1, "drain": True})
    assert drain.drain and drain.watermark_ms == 2**63 - 1 and drain.source_plan is None
    replanned = BatchIntent.from_wire({"batch_time_ms": 5, "parallelism": {"totals": 4}, "replanned_from": {"totals": 2}, "side_plan": [[[0, 1, 2]]]})
    assert replanned.replanned_from == {"totals": 2} and replanned.side_plan == (((0, 1, 2),),)


def test_a_later_version_is_refused_naming_the_batch_and_file(tmp_path: Path) -> None:
    with pytest.raises(StateError, match="intent version 2, this keyscale reads version 1"):
        BatchIntent.from_wire({"v": 2, "batch_time_ms": 5})
    jd = JobDir(tmp_path / "job")
    jd.claim("j", 8, 8)
    jd.store.put(jd.intent_key(3), json.dumps({"v": 2, "batch_time_ms": 5, "parallelism": {}, "plans": "new"}).encode())
    with pytest.raises(StateError, match=r"the intent of batch 3 \(.*checkpoints/intent-000000000003\.json\) has intent version 2"):
        jd.read_intent(3)


def test_an_unreadable_intent_is_named(tmp_path: Path) -> None:
    with pytest.raises(StateError, match=r"intent-7\.json is not a batch intent keyscale can read"):
        BatchIntent.from_wire({"parallelism": {}}, "intent-7.json")


def test_written_through_the_job_directory(tmp_path: Path) -> None:
    jd = JobDir(tmp_path / "job")
    jd.claim("j", 8, 8)
    jd.lock()
    intent = BatchIntent(batch_time_ms=9, parallelism={"a": 2}, watermark_ms=3, source_plan=(((0, 0, 4),),), log_ids={"a": None})
    jd.write_intent(1, intent)
    on_disk = json.loads((tmp_path / "job" / jd.intent_key(1)).read_text())
    assert on_disk["v"] == 1 and on_disk["epoch"] == jd.epoch and on_disk["source_plan"] == [[[0, 0, 4]]]
    assert jd.read_intent(1) == intent.stamped(jd.epoch)
    jd.unlock()

"""Operator uids: one rule (``keyscale.state.uids.check_uid``) for a pipeline's stages and a
bootstrapped savepoint's operators, so no savepoint holds a uid no stage can declare."""

from __future__ import annotations

import doctest
import tempfile
from pathlib import Path

import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st
from pyspark.sql.types import LongType, StringType, StructField, StructType

import keyscale as ks
import keyscale.state.uids as uids_module
from keyscale._pipeline import Stream
from keyscale.errors import KeyscaleError
from keyscale.state_processor import write_savepoint_from_dataframes

SCHEMA = StructType([StructField("k", StringType()), StructField("v", LongType())])
TABLE = pa.table({"k": ["a", "b"], "v": [1, 2]})

# Names near the edge of the rule, and any text at all.
_edgy = st.text(alphabet=st.sampled_from(list("aZ09_-./\\ :é²٣ǅ\x00\t")), max_size=6)
uids = st.one_of(_edgy, st.text(max_size=8), st.sampled_from(["", ".", "..", ".x", "../x", "a/b", "ok", "a-b_c"]))


def pipeline_refusal(uid: str) -> tuple[type, str] | None:
    """What a pipeline says to a stage with this uid (None: accepted). No Spark: the stream
    is given its schema."""
    try:
        Stream(None, schema=SCHEMA).key_by("k").aggregate(uid=uid, n=ks.aggregates.count())  # type: ignore[arg-type]
    except KeyscaleError as e:
        return type(e), str(e)
    return None


def bootstrap_refusal(uid: str) -> tuple[type, str] | None:
    """What bootstrapping a savepoint with an operator of this uid says (None: accepted)."""
    with tempfile.TemporaryDirectory(prefix="uid-") as root:
        dest = Path(root) / "sp"
        try:
            write_savepoint_from_dataframes(dest, "job", {uid: (TABLE, ["k"], {"v": "long"})}, 8)
        except KeyscaleError as e:
            assert not dest.exists() or not any(dest.iterdir())  # a refused uid leaves nothing behind
            return type(e), str(e)
        return None


@settings(max_examples=150, deadline=None)
@given(uids)
def test_pipeline_and_bootstrap_refuse_the_same_uids_in_the_same_words(uid: str) -> None:
    assert pipeline_refusal(uid) == bootstrap_refusal(uid)


def test_examples() -> None:
    for good in ("totals", "a-b_c", "é2"):
        assert pipeline_refusal(good) is None and bootstrap_refusal(good) is None
    # Bootstrap used to accept these (only folder-breaking names were refused).
    for bad in ("a b", "a.b", "a:b", ""):
        refusal = bootstrap_refusal(bad)
        assert refusal is not None and refusal == pipeline_refusal(bad)
        assert refusal[1] == f"uid {bad!r} must be a non-empty name of letters, digits, '-' and '_'"


def test_doctests() -> None:
    result = doctest.testmod(uids_module)
    assert result.attempted > 0 and result.failed == 0

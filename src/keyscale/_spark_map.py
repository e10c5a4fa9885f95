"""``DataFrame.mapInArrow`` in fewer calls to the JVM: part of the fixed cost of a batch.

Every batch plans its reader tasks, each stage and each sink's write as a ``mapInArrow``,
and PySpark's own makes ~33 Py4J round trips a call (plus as many JVM objects for its
garbage-collection thread to release later): it looks up the active session, two Java
classes, the broadcast threshold and two profiler settings, converts the Python
environment and includes to Java collections, and parses the return type, every time.
Those are the same for every call in one Spark context, so :func:`map_in_arrow` looks them
up once per context (a return type once per schema); what is left per call is one
constructor for the pickled function, one for the UDF, the input columns (two calls a
column) and the plan node: ``2 N + 7`` round trips for ``N`` columns, 9-17 in a batch's
plan where PySpark makes 28-37 (docs/benchmarks.md, "The fixed cost of a batch").

What travels is what PySpark's own path sends: the same pickled ``(function, return type)``,
environment, includes and Python executable. Where it would not be, it calls PySpark's
``mapInArrow`` instead: a pickled function over the broadcast threshold (PySpark ships that
as a broadcast), broadcast variables pickled with it, a Python profiler on, or a PySpark
whose Java side takes other arguments (found at the first call, then remembered). An error
on the JVM's side is raised by PySpark's own call too, so it reads as it always did.

**Chaining.** A ``map_in_arrow`` over the output of another, with nothing between them
(a keyed stage and the sink that writes it; Flink calls this operator chaining), runs both
functions in one Python worker: one Spark plan node, one Arrow hand-off from the JVM and
back instead of two, and no second worker per task. Both run in the same task over the
same partition either way (a ``mapInArrow`` keeps its input's partitions), so chaining
changes where the second function runs, not what it sees: the first one's batches reach it
cast to the Arrow types Spark would have sent (:func:`keyscale._spark_types.sent_schema`:
the session's time zone, its large-types setting). Not chained: an input that is cached
(``persist``: other readers share it, and each would run the first function again), or
whose Arrow types cannot be named on this PySpark.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from keyscale._spark_types import sent_schema

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import pyarrow as pa
    from pyspark import SparkContext
    from pyspark.sql import DataFrame
    from pyspark.sql.types import StructType

__all__ = ["map_in_arrow"]


@dataclass
class _Context:
    """What every ``mapInArrow`` of one Spark context shares, looked up once."""

    usable: bool
    threshold: int = 0
    env: Any = None  # java.util.Map of sc.environment
    includes: Any = None  # java.util.List of sc._python_includes
    seen: tuple[Any, ...] = ()  # the Python values env and includes were made from
    no_broadcasts: Any = None  # an empty java.util.List (never mutated on the Java side)
    function_class: Any = None
    udf_class: Any = None
    utils: Any = None  # PythonUtils (toSeq)
    types: dict[str, tuple[StructType, Any]] = field(default_factory=dict)  # schema -> (Python type, Java type)


_contexts: weakref.WeakKeyDictionary[SparkContext, _Context] = weakref.WeakKeyDictionary()


def map_in_arrow(df: DataFrame, fn: Callable[..., Any], schema: StructType | str) -> DataFrame:
    """``df.mapInArrow(fn, schema)``, the same plan, in fewer calls to the JVM (it needs a
    Spark session, so its example is not run here: tests/test_spark_map.py runs it).

    >>> def double(batches):
    ...     import pyarrow.compute as pc
    ...     for b in batches:
    ...         yield b.set_column(0, "id", pc.multiply(b.column(0), 2))
    >>> [r.id for r in map_in_arrow(spark.range(3), double, "id long").collect()]  # doctest: +SKIP
    [0, 2, 4]
    """
    from py4j.protocol import Py4JError, Py4JJavaError

    link = df.__dict__.get(_LINK)  # not getattr: a DataFrame's own looks its columns up in the JVM
    if link is not None and not df.is_cached:
        sent = sent_schema(link.schema, df.sparkSession)
        if sent is not None:
            df, fn = link.source, _chained(link.fn, sent, fn)
    sc = df.sparkSession.sparkContext
    ctx = _context(sc)
    out = None
    if ctx.usable:
        try:
            out = _lean(df, sc, ctx, fn, schema)
        except Py4JJavaError:
            pass  # the JVM refused the plan: PySpark's own call raises it as PySpark words it
        except Py4JError:
            ctx.usable = False  # a Java side that takes other arguments: PySpark's own path from now on
    if out is None:
        out = df.mapInArrow(fn, schema)
    out.__dict__[_LINK] = _Link(df, fn, _parsed(ctx, df, schema)[0])
    return out


#: The attribute of a DataFrame made here that says how (:class:`_Link`).
_LINK = "_keyscale_map_in_arrow"


@dataclass(frozen=True)
class _Link:
    """A ``map_in_arrow`` output's making: its input, function and Spark schema."""

    source: DataFrame
    fn: Callable[..., Any]
    schema: StructType


def _chained(first: Callable[..., Any], sent: pa.Schema, then: Callable[..., Any]) -> Callable[..., Any]:
    """``then`` over ``first``'s batches, as Spark would have handed them on (``sent``)."""

    def chained(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        return then(_as_sent(first(batches), sent))  # type: ignore[no-any-return]

    return chained


def _as_sent(batches: Iterator[pa.RecordBatch], sent: pa.Schema) -> Iterator[pa.RecordBatch]:
    """Each batch in the types ``sent``, by position, as Spark reads a function's output."""
    import pyarrow as pa

    # Always rebuilt: Arrow's type equality overlooks names Spark sets (a list's element field).
    # Casting a column to the type it has copies nothing.
    for b in batches:
        yield pa.RecordBatch.from_arrays([c.cast(t) for c, t in zip(b.columns, sent.types, strict=True)], schema=sent)


def _parsed(ctx: _Context, df: DataFrame, schema: StructType | str) -> tuple[StructType, Any]:
    """``schema`` as a StructType, and as the JVM's type once a usable context made it."""
    key = schema if isinstance(schema, str) else schema.json()
    if key not in ctx.types:
        from pyspark.sql.types import StructType, _parse_datatype_string

        parsed = _parse_datatype_string(schema) if isinstance(schema, str) else schema
        assert isinstance(parsed, StructType)
        ctx.types[key] = (parsed, df.sparkSession._jsparkSession.parseDataType(parsed.json()) if ctx.usable else None)
    return ctx.types[key]


def _lean(df: DataFrame, sc: SparkContext, ctx: _Context, fn: Callable[..., Any], schema: StructType | str) -> DataFrame | None:
    """The plan built from the context's cached parts; None where PySpark's own path must
    build it (a broadcast, a pickled broadcast variable)."""
    from pyspark.serializers import CloudPickleSerializer
    from pyspark.sql import DataFrame as _DataFrame
    from pyspark.sql.pandas.functions import pandas_udf
    from pyspark.util import PythonEvalType

    python_type, java_type = _parsed(ctx, df, schema)
    udf = pandas_udf(fn, returnType=python_type, functionType=PythonEvalType.SQL_MAP_ARROW_ITER_UDF)._unwrapped  # type: ignore[call-overload]
    command: bytes = CloudPickleSerializer().dumps((udf.func, udf.returnType))  # type: ignore[no-untyped-call]
    if len(command) > ctx.threshold or any(True for _ in sc._pickled_broadcast_vars):
        return None
    _refresh(sc, ctx)
    function = ctx.function_class(bytearray(command), ctx.env, ctx.includes, sc.pythonExec, sc.pythonVer, ctx.no_broadcasts, sc._javaAccumulator)
    judf = ctx.udf_class(udf._name, function, java_type, udf.evalType, udf.deterministic, ctx.no_broadcasts, ctx.no_broadcasts)
    columns = [df._jdf.col(_quoted(c)) for c in df.columns]
    jdf = df._jdf.mapInArrow(judf.apply(ctx.utils.toSeq(columns)), False, None)
    return _DataFrame(jdf, df.sparkSession)


def _context(sc: SparkContext) -> _Context:
    """The context's shared parts; unusable where a Python profiler is on (its UDFs are
    wrapped per call) or PySpark's UDF differs from the one this module knows."""
    ctx = _contexts.get(sc)
    if ctx is not None:
        return ctx
    import inspect

    from pyspark.sql.udf import UserDefinedFunction

    jvm = sc._jvm
    profiled = any(sc._conf.get(k, "false") == "true" for k in ("spark.python.profile", "spark.python.profile.memory"))
    known = "include_transpiled" in inspect.signature(UserDefinedFunction._create_judf).parameters
    if profiled or not known or jvm is None:
        ctx = _Context(usable=False)
    else:
        ctx = _Context(
            usable=True, threshold=jvm.PythonUtils.getBroadcastThreshold(sc._jsc), no_broadcasts=jvm.java.util.ArrayList(),
            function_class=jvm.SimplePythonFunction, utils=jvm.PythonUtils, udf_class=getattr(jvm, "org.apache.spark.sql.execution.python.UserDefinedPythonFunction"),
        )
    _contexts[sc] = ctx
    return ctx


def _refresh(sc: SparkContext, ctx: _Context) -> None:
    """The environment and includes as Java collections, made again only when the Python
    side changed (``addPyFile`` adds an include)."""
    includes = list(sc._python_includes or [])
    seen = (tuple(sorted(sc.environment.items())), tuple(includes))
    if seen != ctx.seen:
        assert sc._gateway is not None
        from py4j.java_collections import ListConverter, MapConverter

        ctx.env = MapConverter().convert(dict(sc.environment), sc._gateway._gateway_client)
        ctx.includes = ListConverter().convert(includes, sc._gateway._gateway_client)
        ctx.seen = seen


def _quoted(column: str) -> str:
    """A column name as ``Dataset.col`` reads it (a dot or a backtick is syntax there)."""
    return "`" + column.replace("`", "``") + "`"

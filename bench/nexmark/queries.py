"""The Nexmark queries on keyscale and on Spark Structured Streaming (issue 16, item 2).

Definitions: the Flink Nexmark benchmark (``nexmark-flink/src/main/resources/queries/*.sql``),
with its watermark (``dateTime - INTERVAL '4' SECOND``). The input is what
``bench/nexmark/generator.py`` writes: ``DATA/person``, ``DATA/auction``, ``DATA/bid``, file
``k`` of each stream one slice of the event stream, read one file per micro-batch.

This file is also the keyscale job file (``build(ctx)``, ``--set query=q5 --set data=DATA
--set output=DIR|noop``); ``spark_query(spark, name, data)`` builds the Spark side;
``reference(name, tables)`` computes a query's result with pandas on the whole input; and
``final(name, df)`` reduces an output (updates, appends) to the result it stands for, so that
the three can be compared (``bench/nexmark/run.py --verify``, ``tests/bench``).

Queries (keyscale / Spark):

* q0 passthrough, q1 currency conversion (``0.908 * price``), q2 selection
  (``auction % 123 == 0``): stateless on both.
* q3 local item suggestion: persons in OR/ID/CA joined with their category-10 auctions (a
  regular join: unbounded state). keyscale: a ``KeyedCoProcessFunction`` keyed by person id;
  Spark: a stream-stream inner join without watermark.
* q4 average closing price per category: auctions joined with their bids inside
  ``[dateTime, expires]``, max price per auction, average per category. keyscale: a
  co-process function per auction that emits the auction's final price when the watermark
  passes its expiry (event-time timer), then a running mean per category. Spark: none (an
  aggregation after a stream-stream join needs update mode, which joins refuse).
* q5 hot items: bids per auction in sliding windows (10 s, every 2 s), the auctions with the
  most per window. keyscale: sliding window count, then a keyed stage per window keeping the
  maximum; Spark: windowed count in append mode, the per-window maximum in ``foreachBatch``
  (a window's rows all come out in one batch).
* q6 average selling price per seller: on q9's winning bids, per seller the average of the
  winning prices of their last 10 closed auctions, emitted at each close (Beam's Query6;
  Flink's SQL for it is an OVER window on a join's updating output).
  keyscale: q9, then a process function keyed by seller taking closings in order of expiry
  when the watermark passes it. Spark: none (as q9).
* q7 highest bid per 10 s tumbling window. keyscale: each batch's bids cut to those at
  their window's highest price in the batch (a per-batch transform: the batch's maxima
  per window by a partial aggregation, broadcast back to the bids),
  then a process function keyed by window,
  emitting at the window's end (event-time timer) every bid at the maximum price; Spark:
  ``max(struct(price, ...))`` per window, append mode (one bid per window: a tie at the
  maximum would give one row where Flink and keyscale give all).
* q8 new users: persons and the sellers of auctions in the same 10 s tumbling window.
  keyscale: a batch-at-a-time co-process function keyed by person id / seller
  (``NewUsersBatch``; the per-record ``NewUsers`` with ``per_record=yes``), state dropped
  once the watermark passes the windows' end; Spark: the auctions' windowed count per
  seller (append mode: a (seller, window) comes out once, when the watermark closes it)
  chained into a stream-stream join with the persons on the id and the window.
* q9 winning bids: each auction with its highest bid inside ``[dateTime, expires]`` (the
  earliest of equal prices, then the lowest bidder). keyscale: a co-process function per
  auction, emitting at expiry (as q4's first stage). Spark: none (a top-1 per auction after a
  stream-stream join needs update mode, which joins refuse).
* q11 user sessions: bids per bidder in session windows (gap 10 s). Both: session windows.
* q15 bidding statistics per day, q16 per (channel, day): bids, and distinct bidders and
  auctions, each also per price range (``count(distinct ...) filter (...)``); q16 also the
  day's latest minute. keyscale: Flink's split-distinct rewrite. Every bid becomes a
  bidder row and an auction row (one scan); a first stage keyed by (day, kind, id) keeps
  the price ranges the id was seen in (a bit mask) and emits what is new; then a running
  sum per day. No hot
  key: a day's distinct values are spread over the first stage's key groups, and the
  second stage gets a row per day and batch. Spark: none (it refuses distinct
  aggregations on streams).
* q17 auction statistics per day: counts per price range, min, max, avg, sum per (auction,
  day). Both: running aggregates (Spark update mode).
* q18 last bid per (bidder, auction): keyscale a vectorized function keeping the newest bid;
  Spark ``max(struct(dateTime, ...))`` per key in update mode.
* q19 top 10 bids per auction: keyscale a process function keeping the ten highest; Spark
  none (no top-N in streaming).
* q20 bids of category-10 auctions with the auction's columns (a regular join). keyscale: a
  batch-at-a-time co-process function keyed by auction id (``AuctionBidsBatch``; the
  per-record ``AuctionBids`` with ``per_record=yes``); Spark: a stream-stream inner join
  without watermark.
* ij (not a Nexmark query: the interval join, measured on Nexmark's streams): each
  auction with the bids that came within 10 s after it. keyscale ``interval_join("0
  seconds", "10 seconds")`` keyed by auction id; Spark a stream-stream inner join with
  watermarks and the time range in its condition.
* wj (not a Nexmark query: the window join): each person with the auctions they created in
  the same 10 s tumbling window. keyscale ``window_join(TumblingWindows("10 s"))`` keyed by
  person id / seller; Spark a stream-stream inner join on the id and the window.

Left out: q10 (a filesystem sink partitioned by processing time: not a query of the engine), q12
(processing-time windows: its output depends on the wall clock, so it cannot be compared
with another run), q13 (a side input: a bounded table joined by processing time), q14 (a
user-defined function on q1: nothing new).
"""

from __future__ import annotations

import datetime as dt
import heapq
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
from pyspark.sql import DataFrame
from pyspark.sql import functions as F

import keyscale as ks

NAME = "nexmark"

WATERMARK = "4 seconds"  # Flink Nexmark's: dateTime - INTERVAL '4' SECOND
WATERMARK_MS = 4_000
TS = pa.timestamp("us", tz="UTC")

SCHEMAS = {
    "person": "id long, name string, email_address string, credit_card string, city string, state string, "
              "date_time timestamp, extra string",
    "auction": "id long, item_name string, description string, initial_bid long, reserve long, date_time timestamp, "
               "expires timestamp, seller long, category long, extra string",
    "bid": "auction long, bidder long, price long, channel string, url string, date_time timestamp, extra string",
}
AUCTION_STRUCT = pa.struct([("id", pa.int64()), ("item_name", pa.string()), ("description", pa.string()),
                            ("initial_bid", pa.int64()), ("reserve", pa.int64()), ("date_time", TS), ("expires", TS),
                            ("seller", pa.int64()), ("category", pa.int64()), ("extra", pa.string())])
BID_STRUCT = pa.struct([("auction", pa.int64()), ("bidder", pa.int64()), ("price", pa.int64()), ("channel", pa.string()),
                        ("url", pa.string()), ("date_time", TS), ("extra", pa.string())])

#: Streams each query reads.
STREAMS: dict[str, tuple[str, ...]] = {
    "q0": ("bid",), "q1": ("bid",), "q2": ("bid",), "q3": ("person", "auction"), "q4": ("auction", "bid"),
    "q5": ("bid",), "q6": ("auction", "bid"), "q7": ("bid",), "q8": ("person", "auction"), "q9": ("auction", "bid"), "q11": ("bid",), "q17": ("bid",), "q18": ("bid",),
    "q15": ("bid",), "q16": ("bid",), "q19": ("bid",), "q20": ("auction", "bid"),
    "ij": ("auction", "bid"), "wj": ("person", "auction"),
}
QUERIES = list(STREAMS)
#: Queries with a Spark Structured Streaming equivalent.
SPARK_QUERIES = ["q0", "q1", "q2", "q3", "q5", "q7", "q8", "q11", "q17", "q18", "q20", "ij", "wj"]
#: The columns of each stream that each Spark-runnable query reads: what any engine running
#: the query on Spark must scan (run.py's "Spark, read only" floor reads just these).
READS: dict[str, dict[str, tuple[str, ...]]] = {
    "q0": {"bid": ("auction", "bidder", "price", "date_time", "extra")},
    "q1": {"bid": ("auction", "bidder", "price", "date_time", "extra")},
    "q2": {"bid": ("auction", "price")},
    "q3": {"person": ("id", "name", "city", "state"), "auction": ("id", "seller", "category")},
    "q5": {"bid": ("auction", "date_time")},
    "q7": {"bid": ("auction", "bidder", "price", "date_time", "extra")},
    "q8": {"person": ("id", "name", "date_time"), "auction": ("seller", "date_time")},
    "q11": {"bid": ("bidder", "date_time")},
    "q17": {"bid": ("auction", "price", "date_time")},
    "q18": {"bid": ("auction", "bidder", "price", "channel", "url", "date_time", "extra")},
    "q20": {"auction": ("id", "item_name", "description", "initial_bid", "reserve", "date_time", "expires", "seller", "category", "extra"),
            "bid": ("auction", "bidder", "price", "channel", "url", "date_time", "extra")},
    "ij": {"auction": ("id", "seller", "category", "date_time"), "bid": ("auction", "bidder", "price", "date_time")},
    "wj": {"person": ("id", "name", "date_time"), "auction": ("id", "seller", "date_time")},
}
#: Queries whose output is per event-time window (compared on windows both systems closed).
WINDOWED = {"q5": "window_start", "q7": "window_end", "q8": "starttime", "q11": "window_end", "wj": "window_start"}
#: Queries with running aggregates that ``aggregate(combine=True)`` can take (run.py measures them with it too).
COMBINABLE = ["q15", "q16", "q17"]
#: Queries with a batch-at-a-time co-process function and a per-record one (run.py measures both).
PER_RECORD = ["q4", "q8", "q9", "q20"]
#: Queries with keyed state (for the live-rescale runs).
STATEFUL = ["q3", "q4", "q5", "q6", "q7", "q8", "q9", "q11", "q15", "q16", "q17", "q18", "q19", "q20", "ij", "wj"]

Q3_STATES = ("OR", "ID", "CA")
IJ_SECONDS = 10  # "ij": bids within this long after their auction was created
WINDOW_MS = 10_000
SLIDE_MS = 2_000


def _ms(value: Any) -> int:
    """An event time (a datetime) as epoch milliseconds."""
    return int(value.timestamp() * 1000) if hasattr(value, "timestamp") else int(value)


def _time(ms: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ms / 1000, dt.UTC)


# ---------------------------------------------------------------------------- keyscale functions


class LocalItemSuggestion(ks.KeyedCoProcessFunction):
    """q3: persons (first input, filtered) and their auctions (second, filtered), keyed by
    person id: an auction before its seller waits in state; the seller stays forever."""

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        self.person = ctx.list_state("person", "string")  # name, city, state
        self.waiting = ctx.list_state("auctions", "long")

    def process_element1(self, row: dict[str, Any], ctx: ks.state.Context) -> Iterable[Any]:
        self.person.update([row["name"], row["city"], row["state"]])
        waiting = self.waiting.get()
        if waiting:
            self.waiting.clear()
        return [(row["name"], row["city"], row["state"], a) for a in waiting]

    def process_element2(self, row: dict[str, Any], ctx: ks.state.Context) -> Iterable[Any] | None:
        person = self.person.get()
        if not person:
            self.waiting.add(row["id"])
            return None
        return [(*person, row["id"])]


class ClosingPrice(ks.KeyedCoProcessFunction):
    """q4, first stage: an auction (first input) and its bids (second), keyed by auction id.
    The highest bid with ``dateTime`` in ``[auction.dateTime, expires]``; emitted as the
    auction's final price when the watermark passes ``expires``. Bids before their auction
    wait; bids after the auction closed are dropped (they cannot be inside its window)."""

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        self.auction = ctx.list_state("auction", "long")  # category, start ms, expires ms
        self.best = ctx.value_state("best", "long")
        self.closed = ctx.value_state("closed", "boolean")
        self.pending_t = ctx.list_state("pending_t", "long")
        self.pending_p = ctx.list_state("pending_p", "long")

    def _bid(self, t: int, price: int, start: int, expires: int) -> None:
        if start <= t <= expires:
            best = self.best.value()
            if best is None or price > best:
                self.best.update(price)

    def process_element1(self, row: dict[str, Any], ctx: ks.state.Context) -> None:
        start, expires = _ms(row["date_time"]), _ms(row["expires"])
        self.auction.update([row["category"], start, expires])
        for t, p in zip(self.pending_t.get(), self.pending_p.get(), strict=True):
            self._bid(t, p, start, expires)
        self.pending_t.clear()
        self.pending_p.clear()
        ctx.timer_service.register_event_time_timer(expires)

    def process_element2(self, row: dict[str, Any], ctx: ks.state.Context) -> None:
        if self.closed.value():
            return
        a = self.auction.get()
        if not a:
            self.pending_t.add(_ms(row["date_time"]))
            self.pending_p.add(row["price"])
            return
        self._bid(_ms(row["date_time"]), row["price"], a[1], a[2])

    def on_timer(self, key: Any, timestamp: int, ctx: ks.state.Context) -> Iterable[Any]:
        a, best = self.auction.get(), self.best.value()
        self.auction.clear()
        self.best.clear()
        self.closed.update(True)
        return [(key, a[0], best)] if a and best is not None else []


EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


def _us(value: Any) -> int:
    """An event time (a datetime or pandas Timestamp, UTC) as exact epoch microseconds."""
    if isinstance(value, pd.Timestamp):
        return int(value.value // 1000)
    if value.tzinfo is None:
        value = value.replace(tzinfo=dt.UTC)
    return (value - EPOCH) // dt.timedelta(microseconds=1)


def _bid_rank(bid: dict[str, Any]) -> tuple[int, int, int]:
    """q9's order of an auction's bids: the highest price, then the earliest, then the lowest bidder."""
    return -bid["price"], _us(bid["date_time"]), bid["bidder"]


class WinningBid(ks.KeyedCoProcessFunction):
    """q9 (and q6's first stage): an auction (first input) and its bids (second), keyed by
    auction id. The winning bid, the first in ``_bid_rank`` order among those with
    ``dateTime`` in ``[auction.dateTime, expires]``, is emitted with the auction's columns
    when the watermark passes ``expires``. Bids before their auction wait; bids after it
    closed are dropped (they cannot be inside its window)."""

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        self.auction = ctx.value_state("auction", AUCTION_STRUCT)
        self.best = ctx.value_state("best", BID_STRUCT)
        self.closed = ctx.value_state("closed", "boolean")
        self.pending = ctx.list_state("pending", BID_STRUCT)

    def _bid(self, bid: dict[str, Any], a: dict[str, Any]) -> None:
        if _us(a["date_time"]) <= _us(bid["date_time"]) <= _us(a["expires"]):
            best = self.best.value()
            if best is None or _bid_rank(bid) < _bid_rank(best):
                self.best.update(bid)

    def process_element1(self, row: dict[str, Any], ctx: ks.state.Context) -> None:
        self.auction.update(row)
        for bid in self.pending.get():
            self._bid(bid, row)
        self.pending.clear()
        ctx.timer_service.register_event_time_timer(_ms(row["expires"]))

    def process_element2(self, row: dict[str, Any], ctx: ks.state.Context) -> None:
        if self.closed.value():
            return
        a = self.auction.value()
        if a is None:
            self.pending.add(row)
        else:
            self._bid(row, a)

    def on_timer(self, key: Any, timestamp: int, ctx: ks.state.Context) -> Iterable[Any]:
        a, best = self.auction.value(), self.best.value()
        self.auction.clear()
        self.best.clear()
        self.closed.update(True)
        if a is None or best is None:
            return []
        return [(*(a[c] for c in AUCTION_STRUCT.names), *(best[c] for c in ("auction", "bidder", "price", "date_time", "extra")))]


class WinningBidBatch(ks.VectorizedKeyedCoProcessFunction):
    """q9 (and q6's first stage) a batch at a time (what ``run.py`` measures; the per-record
    :class:`WinningBid` with ``per_record=yes``): the same state and output on Arrow
    columns. Auctions whose ``expires`` the watermark has passed fire first, with the state
    before the batch (as per-record timers do); then each key's best bid is the first in
    ``_bid_rank`` order (then arrival) among its state's best, the bids that waited for its
    auction and the batch's bids within the auction's ``[dateTime, expires]``."""

    pandas_records = False
    event_timers = True

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        self.auction = ctx.value_state("auction", AUCTION_STRUCT)
        self.best = ctx.value_state("best", BID_STRUCT)
        self.closed = ctx.value_state("closed", "boolean")
        self.pending = ctx.value_state("pending", pa.list_(BID_STRUCT))

    def process_batch(self, b: ks.state.KeyedCoBatch) -> tuple[dict[str, Any], pa.Table]:
        auctions, bids = b.arrow1, b.arrow2
        assert auctions is not None and bids is not None and b.due is not None
        n, due = len(b.keys), b.due
        old_auction, old_best = b.state["auction"].to_numpy(dtype=object), b.state["best"].to_numpy(dtype=object)
        some = np.vectorize(lambda v: isinstance(v, dict), otypes=[bool])
        has_auction, has_best = (some(old_auction), some(old_best)) if n else (np.zeros(0, bool), np.zeros(0, bool))
        fire = np.flatnonzero(due & has_auction & has_best)
        fired = _q9_rows(list(old_auction[fire]), list(old_best[fire]))
        # After the firing: a due key's auction and best are gone, and the key is closed.
        has_auction &= ~due
        has_best &= ~due
        closed = b.state["closed"].to_numpy(dtype=bool, na_value=False) | due
        # Each key's auction window (microseconds): this batch's auction, else the state's.
        new_row = np.full(n, -1, dtype=np.int64)
        new_row[b.codes1] = np.arange(len(b.codes1))
        arrived = new_row >= 0
        start, end = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
        for j in np.flatnonzero(has_auction & ~arrived):
            start[j], end[j] = _us(old_auction[j]["date_time"]), _us(old_auction[j]["expires"])
        start[arrived] = _us_column(auctions, "date_time")[new_row[arrived]]
        end[arrived] = _us_column(auctions, "expires")[new_row[arrived]]
        known = has_auction | arrived
        # Candidates, in arrival order: the state's best, bids that waited for an auction that
        # came now, the batch's bids of keys not closed and with an auction.
        pending = b.state["pending"].to_numpy(dtype=object)
        waited = [j for j in np.flatnonzero(arrived) if isinstance(pending[j], list | np.ndarray) and len(pending[j])]
        kept = ~closed[b.codes2]
        take = np.flatnonzero(kept & known[b.codes2])
        held_best = np.flatnonzero(has_best)
        bid_schema = pa.schema(list(BID_STRUCT))
        cand = pa.concat_tables([
            pa.Table.from_pylist(list(old_best[held_best]), schema=bid_schema),
            pa.Table.from_pylist([w for j in waited for w in pending[j]], schema=bid_schema),
            bids.take(take).select(BID_STRUCT.names)])
        codes = np.concatenate([held_best, np.array([j for j in waited for _ in pending[j]], dtype=np.int64), b.codes2[take]]).astype(np.int64)
        t = _us_column(cand, "date_time")
        ok = (start[codes] <= t) & (t <= end[codes])
        rows = np.flatnonzero(ok)
        price, bidder = cand.column("price").to_numpy()[rows], cand.column("bidder").to_numpy()[rows]
        order = rows[np.lexsort((rows, bidder, t[rows], -price, codes[rows]))]
        first = order[np.r_[True, codes[order][1:] != codes[order][:-1]]] if len(order) else order
        best = np.where(has_best, old_best, None)
        best[codes[first]] = cand.take(first).to_pylist()
        # Bids of keys with no auction yet wait for it.
        new_pending = np.full(n, None, dtype=object)
        for j in np.flatnonzero(~known & np.array([isinstance(p, list | np.ndarray) and len(p) > 0 for p in pending], dtype=bool)):
            new_pending[j] = list(pending[j])
        wait = np.flatnonzero(kept & ~known[b.codes2])
        for j, bid in zip(b.codes2[wait], bids.take(wait).select(BID_STRUCT.names).to_pylist(), strict=True):
            new_pending[j] = [*(new_pending[j] or []), bid]
        auction = np.where(has_auction, old_auction, None)
        auction[arrived] = auctions.take(new_row[arrived]).select(AUCTION_STRUCT.names).to_pylist()
        timer = pd.Series(end // 1000, dtype="Int64").where(known)  # the window's end, in ms, as WinningBid's timer
        return {"auction": pd.Series(auction, dtype=object), "best": pd.Series(best, dtype=object),
                "closed": pd.Series(np.where(closed, True, None), dtype=object), "pending": pd.Series(new_pending, dtype=object),
                ks.state.TIMER: timer}, fired


def _us_column(table: pa.Table, column: str) -> np.ndarray:
    """A timestamp column as epoch microseconds."""
    return table.column(column).cast(pa.timestamp("us", tz="UTC")).cast(pa.int64()).to_numpy()


def _q9_rows(auctions: list[dict[str, Any]], best: list[dict[str, Any]]) -> pa.Table:
    rows = [(*(a[c] for c in AUCTION_STRUCT.names), *(w[c] for c in ("auction", "bidder", "price", "date_time", "extra")))
            for a, w in zip(auctions, best, strict=True)]
    return pa.Table.from_pylist([dict(zip(Q9_ARROW.names, r, strict=True)) for r in rows], schema=Q9_ARROW)


Q9_SCHEMA = ("id long, item_name string, description string, initial_bid long, reserve long, date_time timestamp, "
             "expires timestamp, seller long, category long, extra string, auction long, bidder long, price long, "
             "bid_date_time timestamp, bid_extra string")
Q9_ARROW = pa.schema([*AUCTION_STRUCT, *(BID_STRUCT.field(c).with_name({"date_time": "bid_date_time", "extra": "bid_extra"}.get(c, c))
                                      for c in ("auction", "bidder", "price", "date_time", "extra"))])
CLOSING = pa.struct([("expires_us", pa.int64()), ("auction", pa.int64()), ("price", pa.int64())])


class AverageSellingPrice(ks.KeyedProcessFunction):
    """q6, second stage: keyed by seller, the winning prices of their last 10 closed
    auctions; each auction that closes emits the seller's average over them (Beam's Query6).
    Closings are taken in order of expiry (microseconds), then auction id, when the
    watermark passes it: every closing up to the watermark has come by then, so how batches
    cut the stream changes nothing (but for an auction that came after the watermark had
    passed its expiry: it closes a batch late, after the others)."""

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        self.prices = ctx.list_state("prices", "long")  # the last ten, oldest first
        self.pending = ctx.list_state("pending", CLOSING)

    def process(self, key: Any, rows: Any, ctx: ks.state.Context) -> Iterable[Any]:
        for r in rows:
            expires = _us(r.expires)
            self.pending.add({"expires_us": expires, "auction": r.id, "price": r.price})
            ctx.timer_service.register_event_time_timer(expires // 1000)
        return []

    def on_timer(self, key: Any, timestamp: int, ctx: ks.state.Context) -> Iterable[Any]:
        pending = sorted(self.pending.get(), key=lambda c: (c["expires_us"], c["auction"]))
        due = [c for c in pending if c["expires_us"] // 1000 <= timestamp]
        if not due:
            return []
        self.pending.update(pending[len(due):])
        prices, out = self.prices.get(), []
        for c in due:
            prices = [*prices, c["price"]][-10:]
            out.append((key, c["auction"], sum(prices) / len(prices)))
        self.prices.update(prices)
        return out


class HotItems(ks.KeyedProcessFunction):
    """q5, second stage: keyed by window start, the (auction, count) rows of a window (all
    in the batch where the window fired); emits those at the window's maximum count."""

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        self.max = ctx.value_state("max", "long")

    def process(self, key: Any, rows: Any, ctx: ks.state.Context) -> Iterable[Any]:
        best = max(r.num for r in rows)
        prev = self.max.value()
        if prev is not None and prev > best:
            return []
        self.max.update(best)
        return [(r.auction, r.num, r.window_start, r.window_end) for r in rows if r.num == best]


class HighestBid(ks.KeyedProcessFunction):
    """q7: keyed by 10 s window (start, epoch ms), the bids at the window's highest price so
    far; emitted when the watermark passes the window's end (every bid at the maximum)."""

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        self.price = ctx.value_state("price", "long")
        self.bids = ctx.list_state("bids", BID_STRUCT)

    def process(self, key: Any, rows: Any, ctx: ks.state.Context) -> Iterable[Any]:
        best = max(r.price for r in rows)
        prev = self.price.value()
        if prev is None:
            ctx.timer_service.register_event_time_timer(key + WINDOW_MS - 1)
        if prev is not None and prev > best:
            return []
        top = [{k: getattr(r, k) for k in BID_STRUCT.names} for r in rows if r.price == best]
        if prev == best:
            self.bids.add_all(top)
        else:
            self.price.update(best)
            self.bids.update(top)
        return []

    def on_timer(self, key: Any, timestamp: int, ctx: ks.state.Context) -> Iterable[Any]:
        out = [(b["auction"], b["price"], b["bidder"], b["date_time"], b["extra"], _time(key + WINDOW_MS))
               for b in self.bids.get()]
        self.price.clear()
        self.bids.clear()
        return out


class NewUsers(ks.KeyedCoProcessFunction):
    """q8: persons (first) and auctions (second) keyed by person id / seller: a person and
    an auction of theirs in the same 10 s tumbling window give one row per (person, window).
    A person's state goes when the watermark passes the end of their window; the windows of
    auctions seen before their seller, at the end of each such window."""

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        self.name = ctx.value_state("name", "string")
        self.window = ctx.value_state("window", "long")
        self.emitted = ctx.value_state("emitted", "boolean")
        self.auction_windows = ctx.list_state("auction_windows", "long")

    def process_element1(self, row: dict[str, Any], ctx: ks.state.Context) -> Iterable[Any]:
        w = _ms(row["date_time"]) // WINDOW_MS * WINDOW_MS
        self.name.update(row["name"])
        self.window.update(w)
        ctx.timer_service.register_event_time_timer(w + WINDOW_MS - 1)
        if w in self.auction_windows.get():
            self.emitted.update(True)
            return [(row["id"], row["name"], _time(w))]
        return []

    def process_element2(self, row: dict[str, Any], ctx: ks.state.Context) -> Iterable[Any]:
        w = _ms(row["date_time"]) // WINDOW_MS * WINDOW_MS
        mine = self.window.value()
        if mine is None:
            if w not in self.auction_windows.get():
                self.auction_windows.add(w)
                ctx.timer_service.register_event_time_timer(w + WINDOW_MS - 1)
            return []
        if mine == w and not self.emitted.value():
            self.emitted.update(True)
            return [(row["seller"], self.name.value(), _time(w))]
        return []

    def on_timer(self, key: Any, timestamp: int, ctx: ks.state.Context) -> None:
        ws = self.auction_windows.get()
        if ws:
            self.auction_windows.update([w for w in ws if w + WINDOW_MS - 1 > timestamp])
        mine = self.window.value()
        if mine is not None and mine + WINDOW_MS - 1 <= timestamp:
            self.name.clear()
            self.window.clear()
            self.emitted.clear()


class NewUsersBatch(ks.VectorizedKeyedCoProcessFunction):
    """q8 a batch at a time (what ``run.py`` measures; :class:`NewUsers` per record, with
    ``per_record=yes``): the same state and output on Arrow columns. A key's windows that
    the watermark has closed go first (the per-record function's timers); then a person
    known (from the state or this batch) is emitted once if an auction of theirs falls in
    their window (this batch's auctions, or those that came before the person); auctions of
    a person not seen yet keep their windows. One event-time timer per key: the end of the
    earliest window it holds. Like Nexmark's generator, it takes a person's id to come once
    (a second person record of an id in one batch: the last wins)."""

    pandas_records = False
    event_timers = True
    input_columns1 = ("id", "name", "date_time")
    input_columns2 = ("seller", "date_time")

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        self.name = ctx.value_state("name", "string")
        self.window = ctx.value_state("window", "long")
        self.emitted = ctx.value_state("emitted", "boolean")
        self.auction_windows = ctx.value_state("auction_windows", pa.list_(pa.int64()))

    def process_batch(self, b: ks.state.KeyedCoBatch) -> tuple[dict[str, Any], pa.Table]:
        persons, auctions = b.arrow1, b.arrow2
        assert persons is not None and auctions is not None
        n = len(b.keys)
        closed = -1 if b.watermark is None else b.watermark - WINDOW_MS + 1  # windows starting at or before it have ended
        # The state, with the windows the watermark closed dropped.
        name = b.state["name"].to_numpy(dtype=object, na_value=None).copy()
        window = b.state["window"].to_numpy(dtype=np.int64, na_value=-1).copy()
        emitted = b.state["emitted"].to_numpy(dtype=bool, na_value=False).copy()
        gone = (window >= 0) & (window <= closed)
        name[gone], window[gone], emitted[gone] = None, -1, False
        held = b.state["auction_windows"].to_numpy(dtype=object)
        seen = [set() if not isinstance(ws, list | np.ndarray) else {int(w) for w in ws if w > closed} for ws in held]
        # This batch's persons (the last of a key wins) and auctions, each with its window.
        p_window = _us_column(persons, "date_time") // 1000 // WINDOW_MS * WINDOW_MS
        new = np.full(n, -1, dtype=np.int64)
        new[b.codes1] = np.arange(len(b.codes1))
        came = np.flatnonzero(new >= 0)
        known_before = window >= 0
        window[came] = p_window[new[came]]
        name[came] = np.asarray(persons.column("name").to_pylist(), dtype=object)[new[came]]
        # The windows of auctions whose seller was not known before this batch are kept (one
        # whose seller came now is decided below; its windows go with the watermark).
        a_window = _us_column(auctions, "date_time") // 1000 // WINDOW_MS * WINDOW_MS
        for j, w in zip(b.codes2.tolist(), a_window.tolist(), strict=True):
            if not known_before[j]:
                seen[j].add(w)
        # A person is emitted once, when an auction of theirs is in their window.
        match = np.zeros(n, dtype=bool)
        match[b.codes2[a_window == window[b.codes2]]] = True
        match |= np.array([window[j] in seen[j] for j in range(n)], dtype=bool)
        out = np.flatnonzero(match & (window >= 0) & ~emitted)
        emitted[out] = True
        ids = b.keys.iloc[:, 0].to_numpy()[out]
        rows = pa.table({"id": pa.array(ids, pa.int64()), "name": pa.array(name[out].tolist(), pa.string()),
                         "starttime": pa.array(window[out] * 1000, pa.int64()).cast(TS)})
        # Each key's timer: the end of the earliest window it holds.
        ends = [min([*seen[j], *([window[j]] if window[j] >= 0 else [])], default=None) for j in range(n)]
        timer = pd.Series([None if e is None else e + WINDOW_MS - 1 for e in ends], dtype="Int64")
        has = window >= 0
        return {"name": pd.Series(np.where(has, name, None), dtype=object), "window": pd.Series(window, dtype="Int64").where(has),
                "emitted": pd.Series(np.where(has & emitted, True, None), dtype=object),
                "auction_windows": pd.Series([sorted(ws) if ws else None for ws in seen], dtype=object), ks.state.TIMER: timer}, rows


class LastBid(ks.VectorizedKeyedFunction):
    """q18: keyed by (bidder, auction), the newest bid (by dateTime; the later record on a
    tie); emits a key's bid when it is newer than the one in state."""

    pandas_records = False  # the bids' string columns go to the output: Arrow take, no pandas

    def __init__(self) -> None:
        self.input_columns = ["price", "channel", "url", "date_time", "extra"]

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        ctx.value_state("last_us", "long")

    def process_batch(self, batch: Any) -> tuple[dict[str, Any], pa.Table]:
        recs = batch.arrow
        t = recs.column("date_time").cast(pa.int64()).to_numpy()  # microseconds since the epoch
        order = np.lexsort((np.arange(len(t)), t, batch.codes))
        last = order[batch.starts[1:] - 1]  # sorted by key code, then time, then arrival: each key's newest
        prev = batch.state["last_us"].to_numpy(dtype=np.int64, na_value=np.iinfo(np.int64).min)
        newer = t[last] > prev
        keys = pa.Table.from_pandas(batch.keys.loc[newer], preserve_index=False)
        picked = recs.take(last[newer]).select(self.input_columns)
        out = pa.Table.from_arrays([*keys.columns, *picked.columns], names=[*keys.column_names, *picked.column_names])
        return {"last_us": np.where(newer, t[last], prev)}, out


#: q15/q16's counts, per price range: (bids, bidders, auctions) x (all, rank 1, 2, 3).
Q15_COUNTS = [f"{prefix}{what}" for what in ("bids", "bidders", "auctions") for prefix in ("total_", "rank1_", "rank2_", "rank3_")]
BIDDER, AUCTION = 0, 1  # the kinds of q15's distinct rows


class NewDistinct(ks.VectorizedKeyedFunction):
    """q15/q16, the split distinct's first level: keyed by (day..., kind, id), where a bid
    is a ``kind`` 0 row (its bidder) and a ``kind`` 1 row (its auction), ``rank`` its price
    range's bit (1, 2, 4). State: the ranges this id was seen in. Emits per key of the
    batch what it adds to the day's counts: its bids (kind 0 only) and, where the id is
    new to the day or to a range, one distinct bidder or auction there."""

    def __init__(self, group: list[str]) -> None:
        self.group = group
        self.input_columns = ["rank", "minute"]

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        ctx.value_state("seen", "long")

    def process_batch(self, batch: Any) -> tuple[dict[str, Any], pd.DataFrame]:
        rank = batch.records["rank"].to_numpy(dtype=np.int64)[batch.order]
        firsts = batch.starts[:-1]
        seen_now = np.bitwise_or.reduceat(rank, firsts)
        prev = batch.state["seen"].to_numpy(dtype=np.int64, na_value=0)
        new = seen_now & ~prev
        kind = batch.keys["kind"].to_numpy()
        out = batch.keys[self.group].reset_index(drop=True)
        bids = np.where(kind == BIDDER, np.diff(batch.starts), 0)
        out["total_bids"] = bids
        for r, bit in ((1, 1), (2, 2), (3, 4)):
            out[f"rank{r}_bids"] = np.where(kind == BIDDER, np.add.reduceat((rank == bit).astype(np.int64), firsts), 0)
        for k, what in ((BIDDER, "bidders"), (AUCTION, "auctions")):
            mine = kind == k
            out[f"total_{what}"] = (mine & (prev == 0)).astype(np.int64)
            for r, bit in ((1, 1), (2, 2), (3, 4)):
                out[f"rank{r}_{what}"] = (mine & (new & bit != 0)).astype(np.int64)
        out["minute"] = np.maximum.reduceat(batch.records["minute"].to_numpy(dtype=np.int64)[batch.order], firsts)
        return {"seen": prev | seen_now}, out[[*self.group, *Q15_COUNTS, "minute"]]


class TopBids(ks.KeyedProcessFunction):
    """q19: keyed by auction, its ten highest bids; emits the new top ten (with ranks)
    whenever a batch changes it."""

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        self.top = ctx.list_state("top", BID_STRUCT)

    def process(self, key: Any, rows: Any, ctx: ks.state.Context) -> Iterable[Any]:
        old = self.top.get()
        floor = old[-1]["price"] if len(old) >= 10 else -1
        fresh = [r for r in rows if r.price > floor]
        if not fresh:
            return []
        cands = old + [{k: getattr(r, k) for k in BID_STRUCT.names} for r in fresh]
        top = heapq.nlargest(10, cands, key=lambda b: b["price"])
        self.top.update(top)
        return [(b["auction"], b["bidder"], b["price"], b["channel"], b["url"], b["date_time"], b["extra"], i + 1)
                for i, b in enumerate(top)]


class AuctionBids(ks.KeyedCoProcessFunction):
    """q20: auctions (first) and bids (second) keyed by auction id: each bid of a
    category-10 auction, with the auction's columns. A bid before its auction waits; the
    auction stays (a regular join); a bid of another category's auction is dropped."""

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        self.auction = ctx.list_state("auction", AUCTION_STRUCT)
        self.other = ctx.value_state("other", "boolean")
        self.waiting = ctx.list_state("waiting", BID_STRUCT)

    @staticmethod
    def _join(b: dict[str, Any], a: dict[str, Any]) -> tuple[Any, ...]:
        return (b["auction"], b["bidder"], b["price"], b["channel"], b["url"], b["date_time"], b["extra"],
                a["item_name"], a["description"], a["initial_bid"], a["reserve"], a["date_time"], a["expires"],
                a["seller"], a["category"], a["extra"])

    def process_element1(self, row: dict[str, Any], ctx: ks.state.Context) -> Iterable[Any]:
        waiting = self.waiting.get()
        self.waiting.clear()
        if row["category"] != 10:
            self.other.update(True)
            return []
        self.auction.update([row])
        return [self._join(b, row) for b in waiting]

    def process_element2(self, row: dict[str, Any], ctx: ks.state.Context) -> Iterable[Any]:
        if self.other.value():
            return []
        a = self.auction.get()
        if not a:
            self.waiting.add(row)
            return []
        return [self._join(row, a[0])]


class AuctionBidsBatch(ks.VectorizedKeyedCoProcessFunction):
    """q20 a batch at a time (what ``run.py`` measures; :class:`AuctionBids` per record, as
    ``variant=per-record``): the same state and output, on Arrow columns. A key's auction
    (this batch's or the state's) joins every bid of the batch; bids of a key whose auction
    is still unknown wait in an array state and join when it comes; a key whose auction is
    of another category drops its bids."""

    pandas_records = False  # every column goes to the output: Arrow take, no pandas

    def open(self, ctx: ks.state.RuntimeContext) -> None:
        self.auction = ctx.value_state("auction", AUCTION_STRUCT)  # the category-10 auction's row
        self.other = ctx.value_state("other", "boolean")
        self.waiting = ctx.value_state("waiting", pa.list_(BID_STRUCT))

    def process_batch(self, b: ks.state.KeyedCoBatch) -> tuple[dict[str, Any], pa.Table]:
        auctions, bids = b.arrow1, b.arrow2
        assert auctions is not None and bids is not None
        n = len(b.keys)
        state_auction = b.state["auction"].to_numpy(dtype=object)
        held = np.array([isinstance(a, dict) for a in state_auction], dtype=bool)
        ten = auctions.column("category").to_numpy() == 10
        other = b.state["other"].to_numpy(dtype=bool, na_value=False).copy()
        other[b.codes1[~ten]] = True
        new_row = np.full(n, -1, dtype=np.int64)  # this batch's auction row per key
        new_row[b.codes1[ten]] = np.flatnonzero(ten)
        # One table of every known auction of the batch's keys: this batch's, then the state's.
        fresh, old = np.flatnonzero(new_row >= 0), np.flatnonzero(held & (new_row < 0))
        known = pa.concat_tables([auctions.take(new_row[fresh]).select(AUCTION_STRUCT.names),
                                  pa.Table.from_pylist(list(state_auction[old]), schema=pa.schema(list(AUCTION_STRUCT)))])
        row_of = np.full(n, -1, dtype=np.int64)
        row_of[fresh], row_of[old] = np.arange(len(fresh)), len(fresh) + np.arange(len(old))
        # Bids that wait from earlier batches and whose auction came now.
        waiting = b.state["waiting"].to_numpy(dtype=object)
        come = [j for j in fresh if isinstance(waiting[j], list | np.ndarray) and len(waiting[j])]
        earlier = pa.Table.from_pylist([w for j in come for w in waiting[j]], schema=pa.schema(list(BID_STRUCT)))
        earlier_keys = np.array([j for j in come for _ in waiting[j]], dtype=np.int64)
        joins = row_of[b.codes2] >= 0
        out_bids = pa.concat_tables([earlier, bids.take(np.flatnonzero(joins)).select(BID_STRUCT.names)])
        out_rows = np.concatenate([row_of[earlier_keys], row_of[b.codes2[joins]]])
        side = known.take(out_rows)
        out = pa.Table.from_arrays([*out_bids.columns, *(side.column(c) for c in Q20_AUCTION_COLUMNS)], schema=Q20_ARROW)
        # What waits now: bids of keys with no auction yet (and not of another category).
        new_waiting = np.full(n, None, dtype=object)
        still = (row_of < 0) & ~other
        for j in np.flatnonzero(still & np.array([isinstance(w, list | np.ndarray) for w in waiting], dtype=bool)):
            new_waiting[j] = list(waiting[j])
        late = np.flatnonzero(still[b.codes2])
        for j, bid in zip(b.codes2[late], bids.take(late).select(BID_STRUCT.names).to_pylist(), strict=True):
            if new_waiting[j] is None:
                new_waiting[j] = []
            new_waiting[j].append(bid)
        auction_state = state_auction.copy()
        auction_state[fresh] = known.slice(0, len(fresh)).to_pylist()
        return {"auction": pd.Series(auction_state, dtype=object), "other": np.where(other, True, None),
                "waiting": pd.Series(new_waiting, dtype=object)}, out


Q20_SCHEMA = ("auction long, bidder long, price long, channel string, url string, date_time timestamp, extra string, "
              "item_name string, description string, initial_bid long, reserve long, a_date_time timestamp, "
              "expires timestamp, seller long, category long, a_extra string")
Q20_AUCTION_COLUMNS = ["item_name", "description", "initial_bid", "reserve", "date_time", "expires", "seller", "category", "extra"]
Q20_ARROW = pa.schema([*BID_STRUCT, *(AUCTION_STRUCT.field(c).with_name({"date_time": "a_date_time", "extra": "a_extra"}.get(c, c))
                                       for c in Q20_AUCTION_COLUMNS)])
BID_OUT = "auction long, bidder long, price long, channel string, url string, date_time timestamp, extra string"


def _read(spark: Any, data: str | Path, stream: str) -> DataFrame:
    return spark.readStream.schema(SCHEMAS[stream]).option("maxFilesPerTrigger", 1).parquet(str(Path(data) / stream))


def _day(df: DataFrame) -> DataFrame:
    return df.withColumn("day", F.date_format("date_time", "yyyy-MM-dd"))


def _q17_columns(df: DataFrame) -> DataFrame:
    # One withColumns, not four withColumn (each is an analysis of the whole plan; keyscale
    # plans its transforms every batch, Spark's query once).
    price = F.col("price")
    return df.withColumns({"day": F.date_format("date_time", "yyyy-MM-dd"), "r1": (price < 10_000).cast("long"),
                           "r2": ((price >= 10_000) & (price < 1_000_000)).cast("long"), "r3": (price >= 1_000_000).cast("long")})


def _q15_rows(group: list[str]) -> Any:
    """q15/q16's input to the distinct stage: each bid as a bidder row and an auction row,
    with its price range's bit and its minute of the day (one scan of the batch)."""
    def rows(df: DataFrame) -> DataFrame:
        rank = F.when(F.col("price") < 10_000, 1).when(F.col("price") < 1_000_000, 2).otherwise(4)
        minute = F.hour("date_time") * 60 + F.minute("date_time")
        shared = [F.col(c).alias(c) for c in group] + [rank.cast("long").alias("rank"), minute.cast("long").alias("minute")]
        both = F.array(F.struct(F.lit(BIDDER).alias("kind"), F.col("bidder").alias("id"), *shared),
                       F.struct(F.lit(AUCTION).alias("kind"), F.col("auction").alias("id"), *shared))
        return _day(df).select(F.inline(both))
    return rows


def _hh_mm(df: DataFrame) -> DataFrame:
    return df.withColumn("minute", F.format_string("%02d:%02d", (F.col("minute") / 60).cast("int"), F.col("minute") % 60))


def _window_ms(col: str) -> Any:
    return (F.unix_millis(F.col(col)) - F.pmod(F.unix_millis(F.col(col)), F.lit(WINDOW_MS))).alias("w")


def keyscale_query(spark: Any, name: str, data: str | Path, combine: bool = False, per_record: bool = False) -> ks.streams.Stream:
    """Query ``name`` as a keyscale stream (before its sink); ``combine``: the running
    aggregates of COMBINABLE's queries with ``combine=True`` (measured slower or level on
    them: docs/benchmarks.md); ``per_record``: PER_RECORD's queries with their per-record
    co-process function instead of the batch-at-a-time one."""
    def stream(s: str) -> ks.streams.Stream:
        return ks.stream(_read(spark, data, s)).with_watermark("date_time", WATERMARK)

    if name == "q0":
        return stream("bid").select("auction", "bidder", "price", "date_time", "extra")
    if name == "q1":
        return stream("bid").select("auction", "bidder", (F.lit(0.908) * F.col("price")).alias("price"), "date_time", "extra")
    if name == "q2":
        return stream("bid").filter(F.col("auction") % 123 == 0).select("auction", "price")
    if name == "q3":
        persons = stream("person").filter(F.col("state").isin(*Q3_STATES))
        auctions = stream("auction").filter(F.col("category") == 10)
        return persons.connect(auctions).key_by("id", "seller").process(
            LocalItemSuggestion(), "name string, city string, state string, id long", uid="q3")
    if name == "q4":
        if per_record:
            closing = stream("auction").connect(stream("bid")).key_by("id", "auction").process(
                ClosingPrice(), "auction long, category long, final long", uid="q4_closing")
        else:  # q9's winning bid has the highest price in the auction's window: its final price
            closing = stream("auction").connect(stream("bid")).key_by("id", "auction").process(
                WinningBidBatch(), Q9_SCHEMA, uid="q4_closing").select(F.col("id").alias("auction"), "category", F.col("price").alias("final"))
        return closing.key_by("category").aggregate(uid="q4_avg", avg_final=ks.aggregates.mean("final"))
    if name in ("q6", "q9"):
        winners = stream("auction").connect(stream("bid")).key_by("id", "auction").process(
            WinningBid() if per_record else WinningBidBatch(), Q9_SCHEMA, uid="q9")
        if name == "q9":
            return winners
        return winners.key_by("seller").process(AverageSellingPrice(), "seller long, auction long, avg_price double", uid="q6")
    if name == "q5":
        counts = stream("bid").key_by("auction").window(ks.windows.SlidingWindows(f"{WINDOW_MS} ms", f"{SLIDE_MS} ms")).aggregate(
            uid="q5_counts", num=ks.aggregates.count())
        return counts.key_by("window_start").process(
            HotItems(), "auction long, num long, window_start timestamp, window_end timestamp", uid="q5_hot")
    if name == "q7":
        # A batch's transform runs on that batch alone: only its bids at their window's
        # highest price in the batch can be a window's highest, so only those reach Python.
        # The maxima are a partial aggregation (a few rows per window through the shuffle),
        # broadcast back to the bids: the batch's bids themselves are never shuffled.
        def batch_top(df: DataFrame) -> DataFrame:
            df = df.select("*", _window_ms("date_time"))
            top = df.groupBy("w").agg(F.max("price").alias("top"))
            return df.join(F.broadcast(top), "w").where(F.col("price") == F.col("top")).drop("top")

        bids = stream("bid").transform(batch_top)
        return bids.key_by("w").process(
            HighestBid(), "auction long, price long, bidder long, date_time timestamp, extra string, window_end timestamp",
            uid="q7")
    if name == "q8":
        return stream("person").connect(stream("auction")).key_by("id", "seller").process(
            NewUsers() if per_record else NewUsersBatch(), "id long, name string, starttime timestamp", uid="q8")
    if name == "q11":
        return stream("bid").key_by("bidder").window(ks.windows.SessionWindows(f"{WINDOW_MS} ms")).aggregate(
            uid="q11", bid_count=ks.aggregates.count())
    if name in ("q15", "q16"):
        group = ["day"] if name == "q15" else ["channel", "day"]
        schema = ", ".join([*(f"{c} string" for c in group), *(f"{c} long" for c in Q15_COUNTS), "minute long"])
        new = stream("bid").transform(_q15_rows(group)).key_by(*group, "kind", "id").process(
            NewDistinct(group), schema, uid=f"{name}_distinct")
        sums = {c: ks.aggregates.sum(c) for c in Q15_COUNTS}
        if name == "q16":
            sums["minute"] = ks.aggregates.max("minute")
        daily = new.key_by(*group).aggregate(uid=name, combine=combine, **sums)
        return daily.transform(_hh_mm) if name == "q16" else daily
    if name == "q17":
        return stream("bid").transform(_q17_columns).key_by("auction", "day").aggregate(
            uid="q17", combine=combine, total_bids=ks.aggregates.count(), rank1_bids=ks.aggregates.sum("r1"), rank2_bids=ks.aggregates.sum("r2"), rank3_bids=ks.aggregates.sum("r3"),
            min_price=ks.aggregates.min("price"), max_price=ks.aggregates.max("price"), avg_price=ks.aggregates.mean("price"), sum_price=ks.aggregates.sum("price"))
    if name == "q18":
        return stream("bid").key_by("bidder", "auction").process(
            LastBid(), "bidder long, auction long, price long, channel string, url string, date_time timestamp, extra string",
            uid="q18")
    if name == "q19":
        return stream("bid").key_by("auction").process(TopBids(), f"{BID_OUT}, rank_number long", uid="q19")
    if name == "q20":
        fn = AuctionBids() if per_record else AuctionBidsBatch()
        return stream("auction").connect(stream("bid")).key_by("id", "auction").process(fn, Q20_SCHEMA, uid="q20")
    if name == "ij":
        auctions = stream("auction").select("id", "seller", "category", "date_time")
        bids = stream("bid").select("auction", "bidder", "price", "date_time")
        return auctions.connect(bids).key_by("id", "auction").interval_join("0 seconds", f"{IJ_SECONDS} seconds", uid="ij")
    if name == "wj":
        persons = stream("person").select("id", "name", "date_time")
        auctions = stream("auction").select("id", "seller", "date_time")
        return persons.connect(auctions).key_by("id", "seller").window_join(ks.windows.TumblingWindows(f"{WINDOW_MS} ms"), uid="wj")
    raise ks.KeyscaleError(f"nexmark: unknown query {name!r} (known: {', '.join(QUERIES)})")


def build(ctx: ks.JobContext) -> ks.Pipeline:
    out = keyscale_query(ctx.spark, ctx.arg("query"), ctx.arg("data"), ctx.arg("combine", "no") == "yes", ctx.arg("per_record", "no") == "yes")
    where = ctx.arg("output", "noop")
    return out.sink(ks.sinks.NoopSink() if where == "noop" else ks.sinks.ParquetSink(where))


# ---------------------------------------------------------------------------- Spark


def spark_query(spark: Any, name: str, data: str | Path) -> tuple[DataFrame, str, Any]:
    """Query ``name`` in Spark Structured Streaming: (DataFrame, output mode, a function
    applied to each micro-batch's output in ``foreachBatch`` before it is written, or None)."""
    def stream(s: str) -> DataFrame:
        return _read(spark, data, s).withWatermark("date_time", WATERMARK)

    if name == "q0":
        return stream("bid").select("auction", "bidder", "price", "date_time", "extra"), "append", None
    if name == "q1":
        return stream("bid").select("auction", "bidder", (F.lit(0.908) * F.col("price")).alias("price"), "date_time",
                                    "extra"), "append", None
    if name == "q2":
        return stream("bid").filter(F.col("auction") % 123 == 0).select("auction", "price"), "append", None
    if name == "q3":
        p = _read(spark, data, "person").filter(F.col("state").isin(*Q3_STATES)).select("id", "name", "city", "state")
        a = _read(spark, data, "auction").filter(F.col("category") == 10).select(F.col("id").alias("aid"), "seller")
        return p.join(a, F.col("id") == F.col("seller")).select("name", "city", "state", F.col("aid").alias("id")), "append", None
    if name == "q5":
        counts = stream("bid").groupBy(F.window("date_time", f"{WINDOW_MS // 1000} seconds", f"{SLIDE_MS // 1000} seconds"),
                                       "auction").agg(F.count("*").alias("num"))

        def hot(df: DataFrame) -> DataFrame:
            m = df.groupBy("window").agg(F.max("num").alias("maxn"))
            return df.join(m, "window").where(F.col("num") >= F.col("maxn")).select(
                "auction", "num", F.col("window.start").alias("window_start"), F.col("window.end").alias("window_end"))
        return counts, "append", hot
    if name == "q7":
        top = stream("bid").groupBy(F.window("date_time", f"{WINDOW_MS // 1000} seconds")).agg(
            F.max(F.struct("price", "auction", "bidder", "date_time", "extra")).alias("m"))
        return top.select("m.auction", "m.price", "m.bidder", "m.date_time", "m.extra",
                          F.col("window.end").alias("window_end")), "append", None
    if name == "q11":
        s = stream("bid").groupBy(F.session_window("date_time", f"{WINDOW_MS // 1000} seconds"), "bidder").agg(
            F.count("*").alias("bid_count"))
        return s.select("bidder", F.col("session_window.start").alias("window_start"),
                        F.col("session_window.end").alias("window_end"), "bid_count"), "append", None
    if name == "q17":
        agg = _q17_columns(_read(spark, data, "bid")).groupBy("auction", "day").agg(
            F.count("*").alias("total_bids"), F.sum("r1").alias("rank1_bids"), F.sum("r2").alias("rank2_bids"),
            F.sum("r3").alias("rank3_bids"), F.min("price").alias("min_price"), F.max("price").alias("max_price"),
            F.avg("price").alias("avg_price"), F.sum("price").alias("sum_price"))
        return agg, "update", None
    if name == "q18":
        last = _read(spark, data, "bid").groupBy("bidder", "auction").agg(
            F.max(F.struct("date_time", "price", "channel", "url", "extra")).alias("m"))
        return last.select("bidder", "auction", "m.price", "m.channel", "m.url", "m.date_time", "m.extra"), "update", None
    if name == "q20":
        a = _read(spark, data, "auction").filter(F.col("category") == 10).select(
            F.col("id").alias("aid"), "item_name", "description", "initial_bid", "reserve",
            F.col("date_time").alias("a_date_time"), "expires", "seller", "category", F.col("extra").alias("a_extra"))
        b = _read(spark, data, "bid")
        cols = [c.split()[0] for c in Q20_SCHEMA.split(", ")]
        return b.join(a, F.col("auction") == F.col("aid")).select(*cols), "append", None
    if name == "ij":
        a = stream("auction").select("id", "seller", "category", "date_time")
        b = stream("bid").select("auction", "bidder", "price", F.col("date_time").alias("date_time_2"))
        cond = (F.col("id") == F.col("auction")) & F.col("date_time_2").between(
            F.col("date_time"), F.col("date_time") + F.expr(f"INTERVAL {IJ_SECONDS} SECONDS"))
        return a.join(b, cond), "append", None
    if name == "q8":
        # Flink's q8 groups persons by (id, name, window) too; a person's id comes once, so
        # the persons need no aggregation before the join.
        w = f"{WINDOW_MS // 1000} seconds"
        p = stream("person").select("id", "name", F.window("date_time", w).alias("pw"))
        a = stream("auction").groupBy("seller", F.window("date_time", w).alias("aw")).agg(F.count("*").alias("n"))
        joined = p.join(a, (F.col("id") == F.col("seller")) & (F.col("pw") == F.col("aw")))
        return joined.select("id", "name", F.col("pw.start").alias("starttime")), "append", None
    if name == "wj":
        w = f"{WINDOW_MS // 1000} seconds"
        # The window is each side's event-time column (Spark allows one): the times themselves
        # pass through as plain copies.
        copy = F.timestamp_micros(F.unix_micros("date_time"))
        p = stream("person").select("id", "name", copy.alias("date_time"), F.window("date_time", w).alias("w"))
        a = stream("auction").select(F.col("id").alias("id_2"), "seller", copy.alias("date_time_2"), F.window("date_time", w).alias("w2"))
        joined = p.join(a, (F.col("id") == F.col("seller")) & (F.col("w") == F.col("w2")))
        return joined.select("id", "name", "date_time", "id_2", "seller", "date_time_2", F.col("w.start").alias("window_start"),
                             F.col("w.end").alias("window_end")), "append", None
    raise ValueError(f"no Spark version of {name}")


def spark_read_only(spark: Any, name: str, data: str | Path) -> DataFrame:
    """The floor of query ``name`` on Spark: its input streams read, only the columns it
    uses (``READS``), and nothing else done (the rows of several streams in one union)."""
    frames = [_read(spark, data, s).select(*cols) for s, cols in READS[name].items()]
    out = frames[0]
    for f in frames[1:]:
        out = out.unionByName(f, allowMissingColumns=True)
    return out


# ---------------------------------------------------------------------------- results


def reference(name: str, t: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """The query's result on the whole input, with pandas (the Flink SQL's meaning)."""
    b = t.get("bid")
    if name == "q0":
        return b[["auction", "bidder", "price", "date_time", "extra"]]
    if name == "q1":
        return b.assign(price=0.908 * b.price)[["auction", "bidder", "price", "date_time", "extra"]]
    if name == "q2":
        return b.loc[b.auction % 123 == 0, ["auction", "price"]]
    if name == "q3":
        p, a = t["person"], t["auction"]
        p = p[p.state.isin(Q3_STATES)][["id", "name", "city", "state"]]
        a = a[a.category == 10][["id", "seller"]].rename(columns={"id": "aid"})
        return p.merge(a, left_on="id", right_on="seller")[["name", "city", "state", "aid"]].rename(columns={"aid": "id"})
    if name == "q4":
        j = t["auction"][["id", "category", "date_time", "expires"]].merge(
            b[["auction", "price", "date_time"]], left_on="id", right_on="auction", suffixes=("", "_b"))
        j = j[(j.date_time_b >= j.date_time) & (j.date_time_b <= j.expires)]
        final = j.groupby(["id", "category"]).price.max().reset_index()
        return final.groupby("category").price.mean().rename("avg_final").reset_index()
    if name in ("q6", "q9"):
        a = t["auction"]
        j = a.merge(b[["auction", "bidder", "price", "date_time", "extra"]].rename(columns={"date_time": "bid_date_time", "extra": "bid_extra"}),
                    left_on="id", right_on="auction")
        j = j[(j.bid_date_time >= j.date_time) & (j.bid_date_time <= j.expires)]
        j = j.sort_values(["price", "bid_date_time", "bidder"], ascending=[False, True, True], kind="stable").groupby("id").head(1)
        if name == "q9":
            return j[[c.split()[0] for c in Q9_SCHEMA.split(", ")]]
        j = j.sort_values(["expires", "id"], kind="stable")
        avg = j.groupby("seller").price.transform(lambda s: s.rolling(10, min_periods=1).mean())
        return pd.DataFrame({"seller": j.seller, "auction": j.id, "avg_price": avg})
    if name == "q5":
        ms = _ms_col(b.date_time)
        rows = []
        for k in range(WINDOW_MS // SLIDE_MS):
            start = ms - ms % SLIDE_MS - k * SLIDE_MS
            rows.append(pd.DataFrame({"auction": b.auction.to_numpy(), "window_start": start}))
        c = pd.concat(rows).groupby(["window_start", "auction"]).size().rename("num").reset_index()
        c = c[c.num >= c.groupby("window_start").num.transform("max")]
        return c.assign(window_end=c.window_start + WINDOW_MS)[["auction", "num", "window_start", "window_end"]]
    if name == "q7":
        w = _ms_col(b.date_time) // WINDOW_MS * WINDOW_MS
        top = b[b.price == b.price.groupby(w).transform("max")]
        return top.assign(window_end=w[top.index] + WINDOW_MS)[["auction", "price", "bidder", "date_time", "extra", "window_end"]]
    if name == "q8":
        p, a = t["person"], t["auction"]
        pw = p.assign(w=_ms_col(p.date_time) // WINDOW_MS * WINDOW_MS)[["id", "name", "w"]]
        aw = a.assign(w=_ms_col(a.date_time) // WINDOW_MS * WINDOW_MS)[["seller", "w"]].drop_duplicates()
        j = pw.merge(aw, left_on=["id", "w"], right_on=["seller", "w"])
        return j.rename(columns={"w": "starttime"})[["id", "name", "starttime"]]
    if name == "q11":
        out = []
        ms = _ms_col(b.date_time)
        for bidder, times in pd.Series(ms).groupby(b.bidder.to_numpy()):
            ts = np.sort(times.to_numpy())
            brk = np.flatnonzero(np.diff(ts) > WINDOW_MS) + 1  # sessions that touch merge (Flink, Spark)
            for seg in np.split(ts, brk):
                out.append((bidder, seg[0], seg[-1] + WINDOW_MS, len(seg)))
        return pd.DataFrame(out, columns=["bidder", "window_start", "window_end", "bid_count"])
    if name in ("q15", "q16"):
        group = ["day"] if name == "q15" else ["channel", "day"]
        d = b.assign(day=b.date_time.dt.strftime("%Y-%m-%d"), minute=b.date_time.dt.strftime("%H:%M"),
                     rank=np.select([b.price < 10_000, b.price < 1_000_000], [1, 2], 3))
        g = d.groupby(group)
        cols = {"total_bids": g.size(), "total_bidders": g.bidder.nunique(), "total_auctions": g.auction.nunique()}
        for r in (1, 2, 3):
            gr = d[d["rank"] == r].groupby(group)
            cols |= {f"rank{r}_bids": gr.size(), f"rank{r}_bidders": gr.bidder.nunique(), f"rank{r}_auctions": gr.auction.nunique()}
        out = pd.DataFrame(cols).fillna(0).astype(np.int64)
        if name == "q16":
            out["minute"] = g.minute.max()
        return out.reset_index()
    if name == "q17":
        d = b.assign(day=b.date_time.dt.strftime("%Y-%m-%d"))
        g = d.groupby(["auction", "day"]).price
        return pd.DataFrame({
            "total_bids": g.size(), "rank1_bids": g.agg(lambda s: int((s < 10_000).sum())),
            "rank2_bids": g.agg(lambda s: int(((s >= 10_000) & (s < 1_000_000)).sum())),
            "rank3_bids": g.agg(lambda s: int((s >= 1_000_000).sum())),
            "min_price": g.min(), "max_price": g.max(), "avg_price": g.mean(), "sum_price": g.sum()}).reset_index()
    if name == "q18":
        last = b.sort_values("date_time", kind="stable").groupby(["bidder", "auction"]).tail(1)
        return last[["bidder", "auction", "price", "channel", "url", "date_time", "extra"]]
    if name == "q19":
        top = b.sort_values(["auction", "price"], ascending=[True, False], kind="stable").groupby("auction").head(10)
        return top.assign(rank_number=top.groupby("auction").cumcount() + 1)[["auction", "rank_number", "price"]]
    if name == "q20":
        a = t["auction"][t["auction"].category == 10].rename(columns={"id": "aid", "date_time": "a_date_time", "extra": "a_extra"})
        j = b.merge(a, left_on="auction", right_on="aid")
        return j[[c.split()[0] for c in Q20_SCHEMA.split(", ")]]
    if name == "ij":
        a = t["auction"][["id", "seller", "category", "date_time"]]
        j = a.merge(b[["auction", "bidder", "price", "date_time"]].rename(columns={"date_time": "date_time_2"}), left_on="id", right_on="auction")
        return j[(j.date_time_2 >= j.date_time) & (j.date_time_2 <= j.date_time + pd.Timedelta(seconds=IJ_SECONDS))]
    if name == "wj":
        p = t["person"][["id", "name", "date_time"]].assign(window_start=_ms_col(t["person"].date_time) // WINDOW_MS * WINDOW_MS)
        a = t["auction"][["id", "seller", "date_time"]].rename(columns={"id": "id_2", "date_time": "date_time_2"})
        a = a.assign(window_start=_ms_col(a.date_time_2) // WINDOW_MS * WINDOW_MS)
        j = p.merge(a, left_on=["id", "window_start"], right_on=["seller", "window_start"])
        return j[["id", "name", "date_time", "id_2", "seller", "date_time_2", "window_start"]]
    raise ValueError(name)


def _epoch(s: pd.Series, unit: str) -> np.ndarray:
    """A timestamp column as integers since the epoch (UTC) in ``unit``."""
    if getattr(s.dt, "tz", None) is not None:
        s = s.dt.tz_convert(None)
    return np.asarray(s.to_numpy().astype(f"datetime64[{unit}]").astype(np.int64))


def _ms_col(s: pd.Series) -> np.ndarray:
    return _epoch(s, "ms")


def final(name: str, out: pd.DataFrame) -> pd.DataFrame:
    """An output (rows with a ``batch`` column where updates matter) as the result it stands for."""
    df = out.copy()
    for c in df.columns:
        if pd.api.types.is_datetime64_any_dtype(df[c]) and c in ("window_start", "window_end", "starttime"):
            df[c] = _ms_col(df[c])
    if name in ("q4", "q15", "q16", "q17", "q18"):
        keys = {"q4": ["category"], "q15": ["day"], "q16": ["channel", "day"], "q17": ["auction", "day"], "q18": ["bidder", "auction"]}[name]
        df = df.sort_values("batch", kind="stable").groupby(keys).tail(1)
    if name == "q19":  # the last top ten emitted for each auction
        last = df.groupby("auction").batch.transform("max")
        df = df[df.batch == last][["auction", "rank_number", "price"]]
    return df.drop(columns=[c for c in ("batch",) if c in df.columns])


def canonical(df: pd.DataFrame) -> pd.DataFrame:
    """Rows in a canonical order, timestamps as UTC microseconds, floats rounded."""
    df = df.copy()
    for c in df.columns:
        if pd.api.types.is_datetime64_any_dtype(df[c]):
            df[c] = _epoch(df[c], "us")
        elif pd.api.types.is_float_dtype(df[c]):
            df[c] = df[c].round(6)
        elif pd.api.types.is_integer_dtype(df[c]):
            df[c] = df[c].astype(np.int64)
    df = df[sorted(df.columns)]
    return df.sort_values(list(df.columns)).reset_index(drop=True)

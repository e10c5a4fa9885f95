"""Event-time windows: how ``KeyedStream.window`` groups a key's records in time.

A window assigner goes to ``window(...)``; the aggregates of :mod:`keyscale.aggregates`
then run per key and window. A window emits once the watermark passes its end (and again
for late records within ``allowed_lateness``): see the event-time guide.

- :class:`TumblingWindows`: fixed, non-overlapping windows of one size;
- :class:`SlidingWindows`: windows of one size every ``slide`` (a record falls in several);
- :class:`SessionWindows`: a key's records closer than ``gap`` in time make one window.

>>> import keyscale as ks
>>> from keyscale.testing import KeyedHarness
>>> h = KeyedHarness.window(ks.windows.TumblingWindows("1 minute"), key_by=["user"],
...                         input_schema="user string, ts long", event_time="ts", n=ks.aggregates.count())
>>> h.process([{"user": "ann", "ts": 1_000}, {"user": "ann", "ts": 61_000}])   # no window has ended
[]
>>> h.advance_watermark(60_000)
>>> h.process()                                                                # the first minute has
[{'user': 'ann', 'window_start': 0, 'window_end': 60000, 'n': 1}]
"""

from keyscale.operators.windows import SessionWindows, SlidingWindows, TumblingWindows

__all__ = ["SessionWindows", "SlidingWindows", "TumblingWindows"]

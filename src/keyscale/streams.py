"""The stream types a pipeline is built of, for annotations: you get them, never make them.

``ks.stream(...)`` returns a :class:`Stream`; ``key_by`` turns it into a
:class:`KeyedStream`, whose ``window`` returns a :class:`WindowedStream`; each ends with
``sink(...)``, a :class:`keyscale.Pipeline`. Name them when a helper of yours takes or
returns a stream, ``def enrich(events: ks.streams.Stream) -> ks.streams.Stream``.

>>> import tempfile
>>> import keyscale as ks
>>> from keyscale.sources import create_log
>>> log = create_log(tempfile.mkdtemp() + "/events", "key string, ts timestamp", partitions=2)
>>> events = ks.stream(ks.sources.log_source(log, uid="events")).with_watermark("ts", "10 seconds")
>>> isinstance(events, ks.streams.Stream)
True
>>> per_key = events.key_by("key")
>>> type(per_key).__name__, type(per_key.window(ks.windows.TumblingWindows("1 minute"))).__name__
('KeyedStream', 'WindowedStream')
"""

from keyscale._stream import KeyedStream, Stream, WindowedStream

__all__ = ["KeyedStream", "Stream", "WindowedStream"]

"""Kafka in and out: :func:`kafka_source` reads a topic with keyscale's reader tasks,
:class:`KafkaSink` writes a topic in transactions; :mod:`keyscale.kafka.broker` starts a
private broker for tests and examples.

A job names them as ``ks.sources.kafka_source`` and ``ks.sinks.KafkaSink`` (the same
objects as here), beside the other sources and sinks.

>>> import keyscale as ks
>>> from keyscale import kafka
>>> kafka.kafka_source is ks.sources.kafka_source and kafka.KafkaSink is ks.sinks.KafkaSink
True
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from keyscale import _lazy
from keyscale.kafka.source import KafkaLog, json_values, kafka_decoder, kafka_source

if TYPE_CHECKING:
    from keyscale.kafka.sink import KafkaSink

_EXPORTS = {"KafkaSink": "keyscale.kafka.sink"}

__all__ = ["KafkaLog", "KafkaSink", "json_values", "kafka_decoder", "kafka_source"]


def __getattr__(name: str) -> Any:
    return _lazy.load(__name__, _EXPORTS, name)

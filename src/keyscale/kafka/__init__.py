"""Kafka in and out: :func:`kafka_source` reads a topic with keyscale's reader tasks,
:class:`KafkaSink` writes a topic in transactions; :mod:`keyscale.kafka.broker` starts a
private broker for tests and examples.

A connector of its own (as a connector package is in bytewax): a job names these
``ks.kafka.kafka_source``, ``ks.kafka.json_values``, ``ks.kafka.KafkaSink``. They sit above
:mod:`keyscale.sources` and :mod:`keyscale.sinks`, whose interfaces they implement.

>>> import keyscale as ks
>>> ks.kafka.KafkaSink("localhost:9092", "counts").describe()
"Kafka topic 'counts' on localhost:9092 (transactions)"
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

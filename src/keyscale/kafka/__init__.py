"""Kafka in and out: :func:`kafka_source` reads a topic with keyscale's reader tasks,
:class:`KafkaSink` writes a topic in transactions; :mod:`keyscale.kafka.broker` starts a
private broker for tests and examples."""

from keyscale.kafka.source import KafkaLog, json_values, kafka_decoder, kafka_source

__all__ = ["KafkaLog", "json_values", "kafka_decoder", "kafka_source"]

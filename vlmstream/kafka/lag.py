"""How far a consumer process is behind the end of the partitions it reads, for its metrics endpoint."""

from __future__ import annotations

from typing import Any, Mapping

from kafka import TopicPartition


class FetchLag:
    """Per owned partition: the end offset the broker reported with the last fetch (kafka-python's ``highwater``)
    less the next offset the consumer has not yet handed to this process (records kafka-python holds in its fetch
    buffer count: the stage has not seen them). Records handed over and still being worked on (an inference
    window, open documents) are not lag: the stage has them.

    ``observe`` runs on the consumer's own thread after each poll (the consumer is not thread-safe) and asks the
    broker nothing; ``total`` may be read from a metrics thread (it reads one dict, replaced whole)."""

    def __init__(self) -> None:
        self._next: dict[TopicPartition, int] = {}
        self.by_partition: dict[TopicPartition, int] = {}

    def observe(self, consumer: Any, batches: Mapping[TopicPartition, list[Any]]) -> None:
        for tp, records in batches.items():
            if records:
                self._next[tp] = records[-1].offset + 1
        owned = consumer.assignment()
        lag = {}
        for tp in owned:
            end, next_offset = consumer.highwater(tp), self._next.get(tp)
            if end is not None and next_offset is not None:
                lag[tp] = max(0, end - next_offset)
        self._next = {tp: offset for tp, offset in self._next.items() if tp in owned}
        self.by_partition = lag

    @property
    def total(self) -> int:
        return sum(self.by_partition.values())

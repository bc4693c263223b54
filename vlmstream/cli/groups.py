"""Each stage's consumer group as the admin client sees it: which group and topics a stage has, the group's state
and members, and the partitions of its topics. Shared by `vlmstream replay` and `vlmstream status`."""

from __future__ import annotations

import time
from typing import Any, Callable, TypeVar

from kafka import TopicPartition
from kafka.errors import CoordinatorLoadInProgressError, CoordinatorNotAvailableError, NotCoordinatorError

from vlmstream.config import Settings

STAGES = ("decode", "infer", "results", "condense")
IDLE_STATES = {"Empty", "Dead"}  # a group with no member: its offsets can be changed without being overwritten

T = TypeVar("T")


def stage_group(settings: Settings, stage: str) -> tuple[str, list[str]]:
    """The consumer group of a stage and the topics it reads."""
    from consumers.results.ownership import results_group_id

    t = settings.topics
    if stage == "decode":
        return settings.decode.group_id, [t.documents]
    if stage == "infer":
        return settings.infer.group_id, [t.images]
    if stage == "results":
        return results_group_id(settings), [t.descriptions, t.deadletter]
    if stage == "condense":
        return settings.condense.group_id, [t.results]
    raise ValueError(f"unknown stage {stage!r}; expected one of {STAGES}")


def retry_until_coordinator(call: Callable[[], T], attempts: int = 15) -> T:
    """``call()``, again with back-off while the broker has no group coordinator to answer it."""
    # A fresh broker answers "coordinator not available" until __consumer_offsets exists, and "load in progress"
    # while the coordinator reads that partition back in (after a start, or when leadership moves to it).
    for attempt in range(attempts):
        try:
            return call()
        except (CoordinatorNotAvailableError, CoordinatorLoadInProgressError, NotCoordinatorError):
            if attempt == attempts - 1:
                raise
            time.sleep(min(2.0, 0.2 * 2 ** attempt))
    raise AssertionError("unreachable")


def group_state(admin: Any, group_id: str) -> tuple[str, list[dict[str, Any]]]:
    described = retry_until_coordinator(lambda: admin.describe_groups([group_id]))[group_id]
    return described.get("group_state") or "Dead", list(described.get("members") or [])


def stage_partitions(admin: Any, topics: list[str]) -> list[TopicPartition]:
    """Every partition of ``topics``, sorted; a topic the cluster does not have gives none."""
    tps = []
    for topic in admin.describe_topics(topics):
        name = topic.get("name") or topic.get("topic")
        for p in topic.get("partitions", []):
            tps.append(TopicPartition(name, p.get("partition_index", p.get("partition"))))
    return sorted(tps)

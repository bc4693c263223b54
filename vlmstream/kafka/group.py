"""Group membership and self-assigned readers, for kafka-python 3.0's ways (ARCHITECTURE.md, rule 6)."""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterable

from kafka import KafkaConsumer, TopicPartition

from vlmstream.config import Settings
from vlmstream.kafka.clients import make_admin
from vlmstream.kafka.errors import FatalPipelineError

log = logging.getLogger(__name__)


def subscribe_when_known(consumer: KafkaConsumer, topics: Iterable[str], listener=None,
                         timeout_s: float = 60.0, should_stop: Callable[[], bool] | None = None) -> None:
    """Subscribe once this consumer's metadata lists partitions for every topic: every group consumer joins so.

    A group leader that assigns while its metadata still lacks a topic's partitions hands out nothing, and
    kafka-python 3.0 does not reliably recover: a consumer of topics created a moment before can be assigned [],
    then left out of its group (the broker lists the group Empty) while it polls on, for good. Knowing the
    partitions before joining closes that window. Raises FatalPipelineError when a topic has none after timeout_s (it does not exist).
    """
    topics = list(topics)
    consumer.subscribe(topics, listener=listener)
    deadline = time.monotonic() + timeout_s
    for topic in topics:
        while not consumer.partitions_for_topic(topic):
            if should_stop is not None and should_stop():
                return
            if time.monotonic() > deadline:
                raise FatalPipelineError(f"topic {topic!r} has no partitions in the cluster metadata after "
                                         f"{timeout_s:.0f}s: does it exist? (`vlmstream topics create`)")
            time.sleep(0.2)
    # One more metadata update now that the subscription is set: the group protocol compares the metadata it
    # assigned with against later updates, and a snapshot taken before the subscription made every first join
    # rebalance twice.
    consumer.topics()


def topic_partitions(consumer: KafkaConsumer, topics: Iterable[str], timeout_s: float = 30.0,
                     missing_ok: bool = False) -> list[TopicPartition]:
    """Every partition of these topics for a consumer that assigns them itself (no group), from its cluster
    metadata. A topic created a moment before may list none yet, which would make a reader miss it silently:
    wait up to timeout_s for each to list some. A topic still without partitions then raises FatalPipelineError,
    or is left out with missing_ok (a reader for whom an absent topic means nothing to read)."""
    topics = list(topics)
    deadline = time.monotonic() + timeout_s
    while True:
        found = {topic: consumer.partitions_for_topic(topic) or set() for topic in topics}
        missing = [topic for topic, partitions in found.items() if not partitions]
        if not missing or missing_ok or time.monotonic() >= deadline:
            break
        time.sleep(0.2)
    if missing and not missing_ok:
        raise FatalPipelineError(f"topics not found on the cluster: {missing} (`vlmstream topics create`)")
    return sorted(TopicPartition(topic, p) for topic, partitions in found.items() for p in partitions)


def listed_members(settings: Settings, group_id: str) -> tuple[set[str], str | None]:
    """The client ids of the group's members as the broker lists them, and the group's state."""
    admin = make_admin(settings)
    try:
        group = admin.describe_groups([group_id])[group_id]
    finally:
        admin.close()
    return {m.get("client_id") for m in group.get("members") or []}, group.get("group_state")


class GroupMembershipWatchdog:
    """Notices a consumer that its group no longer lists, so its owner can rejoin.

    kafka-python 3.0 can lose a member without noticing, on a loaded machine above all: a consumer assigned [], or
    whose partitions were lost, is then absent from the broker's member list for good while it polls on. An empty
    assignment is also normal (more members than partitions, a standby), so only when it has lasted ``grace_s`` does
    the watchdog ask the broker, at most every ``check_every_s``, whether a member with this consumer's client id is
    in the group; when none is, ``left_out`` says so.
    """

    def __init__(self, settings: Settings, group_id: str, client_id: str, *, grace_s: float = 30.0,
                 check_every_s: float = 15.0):
        self.settings, self.group_id, self.client_id = settings, group_id, client_id
        self.grace_s, self.check_every_s = grace_s, check_every_s
        self._empty_since: float | None = None
        self._last_check = 0.0

    def left_out(self, assignment: set[TopicPartition]) -> bool:
        """``assignment``: the consumer's current one (its owner has just read it)."""
        now = time.monotonic()
        if assignment:
            self._empty_since = None
            return False
        if self._empty_since is None:
            self._empty_since = now
        if now - self._empty_since < self.grace_s or now - self._last_check < self.check_every_s:
            return False
        self._last_check = now
        try:
            members, state = listed_members(self.settings, self.group_id)
        except Exception as exc:  # noqa: BLE001 - the broker is busy or away: ask again later
            log.warning("group %s: membership check failed: %r", self.group_id, exc)
            return False
        if self.client_id in members:
            return False
        log.warning("group %s (%s) does not list this consumer (%s) after %.0f s without partitions: rejoining",
                    self.group_id, state, self.client_id, now - self._empty_since)
        self._empty_since = now
        return True


def rewind(consumer: KafkaConsumer, points: dict[TopicPartition, int]) -> None:
    """Seek partitions back to where their dropped work starts, from a rebalance listener.

    A consumer that drops unfinished work when partitions are revoked or lost relies on their next owner starting
    at the commit point. kafka-python 3.0 keeps the fetch position of a partition that comes straight back to the
    same member (``assign_from_subscribed`` preserves its state, eager protocols included), so that owner would go
    on after the dropped records and never redo them. Seeking first makes every owner, this one too, resume there.
    """
    for tp, offset in points.items():
        try:
            consumer.seek(tp, offset)
        except Exception as exc:  # noqa: BLE001 - no longer assigned here: a new owner starts from the commit
            log.debug("rewind of %s to %d skipped: %r", tp, offset, exc)

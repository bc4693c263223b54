"""The membership watchdog: a consumer without partitions is left alone while its group lists it (a standby, more
members than partitions) and told to rejoin once the broker no longer does."""

from __future__ import annotations

import threading
import time

import pytest
from kafka.admin import NewTopic

from vlmstream.config import Settings
from vlmstream.kafka.clients import make_admin, make_consumer, unique_client_id
from vlmstream.kafka.group import GroupMembershipWatchdog, listed_members, topic_partitions


def _listed(settings: Settings, group: str) -> set[str]:
    """The client ids of the group's members, as the broker has them."""
    try:
        return listed_members(settings, group)[0]
    except Exception:  # noqa: BLE001 - no group yet
        return set()


@pytest.mark.kafka
def test_watchdog_rejoins_only_a_consumer_its_group_does_not_list(kafka_settings: Settings, unique: str):
    topic = f"watchdog-{unique}"
    admin = make_admin(kafka_settings)
    admin.create_topics([NewTopic(topic, 1, 1)])
    admin.close()
    # The consumers subscribe once the cluster lists the partition: a group leader that assigns before its metadata
    # has the topic gives nobody the partition, and the rebalance that follows when the metadata comes is where
    # kafka-python can lose a member for good (what the watchdog is for, but not the state this test starts from).
    probe = make_consumer(kafka_settings, None)
    try:
        topic_partitions(probe, [topic])
    finally:
        probe.close()
    stop = threading.Event()

    def keep_polling(consumer):  # each member in its own thread: a join waits for every member to poll
        while not stop.is_set():
            consumer.poll(timeout_ms=100)

    consumers: list = []
    pollers: list[threading.Thread] = []

    def shut_down():
        stop.set()
        for t in pollers:
            t.join(timeout=5)
        for c in consumers:
            c.close()
        stop.clear()
        consumers.clear()
        pollers.clear()

    try:
        # Both members in the group, not only one partition given: the first to join can hold it while the other
        # has not joined yet, and that one would rightly count as left out. A group that has not got there in 20 s
        # has lost a member inside kafka-python; a fresh group is tried then, so the watchdog is checked against
        # a broker that lists the idle member.
        for attempt in range(3):
            group = f"watchdog-{unique}-group{attempt}"
            ids = [unique_client_id(kafka_settings, "test") for _ in range(2)]
            assert ids[0] != ids[1]
            consumers.extend(make_consumer(kafka_settings, group, (topic,), client_id=i) for i in ids)
            pollers.extend(threading.Thread(target=keep_polling, args=(c,), daemon=True) for c in consumers)
            for t in pollers:
                t.start()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not (sorted(len(c.assignment()) for c in consumers) == [0, 1]
                                                       and set(ids) <= _listed(kafka_settings, group)):
                time.sleep(0.3)
            if time.monotonic() < deadline:
                break
            shut_down()
        else:
            pytest.fail("in 3 groups of two, the broker never listed both members with one partition given")
        [idle] = [(c, i) for c, i in zip(consumers, ids) if not c.assignment()]
        member = GroupMembershipWatchdog(kafka_settings, group, idle[1], grace_s=0.2, check_every_s=0)
        assert not member.left_out(idle[0].assignment())  # the empty assignment starts the grace period
        time.sleep(0.3)
        assert not member.left_out(idle[0].assignment())  # the broker lists it: a member with nothing to do stays
        ghost = GroupMembershipWatchdog(kafka_settings, group, "vlmstream-not-in-this-group", grace_s=0.2,
                                        check_every_s=0)
        assert not ghost.left_out(idle[0].assignment())
        time.sleep(0.3)
        assert ghost.left_out(idle[0].assignment())  # no member with that client id: rejoin
    finally:
        shut_down()


def test_an_assignment_restarts_the_watchdogs_grace_period():
    from kafka import TopicPartition

    watchdog = GroupMembershipWatchdog(Settings(), "unused-group", "unused-client", grace_s=0.2, check_every_s=0)
    assert not watchdog.left_out(set())
    time.sleep(0.3)
    assert not watchdog.left_out({TopicPartition("t", 0)})  # partitions again: the empty spell is over
    # A new empty spell starts its own grace period: no broker is asked (none answers for this group here).
    assert not watchdog.left_out(set())


@pytest.mark.kafka
def test_topic_partitions_waits_for_a_new_topic_and_says_which_is_missing(kafka_settings: Settings, unique: str):
    """Readers that assign partitions themselves (export, the run's live view, dead-letter reads) ask right after
    topics are created; an empty answer would make them read nothing without a word."""
    from kafka import KafkaConsumer, TopicPartition

    from vlmstream.kafka.errors import FatalPipelineError
    from vlmstream.kafka.group import topic_partitions
    from vlmstream.kafka.topics import TopicSpec, create_topics

    topic = f"test.{unique}.fresh"
    consumer = KafkaConsumer(**kafka_settings.kafka.client_kwargs(), group_id=None, enable_auto_commit=False)
    try:
        create_topics(kafka_settings, [TopicSpec(topic, 4, 1, {})])
        assert topic_partitions(consumer, [topic]) == [TopicPartition(topic, p) for p in range(4)]
        absent = f"test.{unique}.absent"
        started = time.monotonic()
        with pytest.raises(FatalPipelineError, match=absent):
            topic_partitions(consumer, [topic, absent], timeout_s=1.0)
        assert time.monotonic() - started >= 1.0  # it waited for the topic before giving up
        assert topic_partitions(consumer, [topic, absent], timeout_s=0, missing_ok=True) == \
            [TopicPartition(topic, p) for p in range(4)]
    finally:
        consumer.close()


@pytest.mark.parametrize("error", ["CoordinatorNotAvailableError", "CoordinatorLoadInProgressError",
                                   "NotCoordinatorError"])
def test_group_admin_calls_wait_out_a_coordinator_that_is_not_ready(error: str):
    """A fresh broker, or one that just took over a group's coordinator, answers these for a while; `vlmstream run`
    once died of the load-in-progress one when it read a group's offsets right after starting the broker."""
    import kafka.errors

    from vlmstream.cli.groups import retry_until_coordinator

    calls = []

    def answer():
        calls.append(1)
        if len(calls) < 3:
            raise getattr(kafka.errors, error)()
        return "offsets"

    assert retry_until_coordinator(answer) == "offsets"
    assert len(calls) == 3

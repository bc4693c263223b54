"""A local three-node KRaft cluster (vlmstream.broker with broker.nodes=3) on ports and a home of its own: the
pipeline's topics come out replicated, a node killed under an acks=all producer loses no record, and a node
restarted from an older copy of its data catches up. One cluster for the module, stopped at its end."""

from __future__ import annotations

import os
import shutil
import threading
import time
import uuid
from pathlib import Path

import pytest
from kafka.admin import ConfigResource, ConfigResourceType

from tests.helpers import wait_for
from tests.kafka_helpers import read_topic
from vlmstream.broker import lifecycle
from vlmstream.broker.cluster import active_controller, node_bootstrap, node_pids, partition_leaders
from vlmstream.broker.faults import kill_node, restart_node, restore_node_data, snapshot_node_data
from vlmstream.broker.jars import jar_dir
from vlmstream.config import BrokerSettings, Settings
from vlmstream.kafka.clients import make_admin, make_consumer, make_producer
from vlmstream.kafka.topics import TopicSpec, create_topics, pipeline_topic_specs, replication

pytestmark = [pytest.mark.kafka, pytest.mark.slow]

BASE_PORT = int(os.environ.get("VLMSTREAM_TEST_CLUSTER_PORT", "19192"))
SHARED_JARS = Path.home() / ".cache" / "vlmstream" / "kafka-4.1.1-jars"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    home = tmp_path_factory.mktemp("cluster-home")
    b = BrokerSettings(home=home, port=BASE_PORT, nodes=3, node_heap="384m")
    if SHARED_JARS.is_dir():  # no second Maven download: the jars are the same
        jar_dir(b).symlink_to(SHARED_JARS, target_is_directory=True)
    settings = Settings(broker=b)
    try:
        lifecycle.start(settings)
        yield settings
    finally:
        for node in range(1, b.nodes + 1):  # its data goes with it: no controlled shutdown needed (9 s saved)
            kill_node(settings, node, reason="test_cluster: the module's cluster, at its end")
        shutil.rmtree(home, ignore_errors=True)


def _topic(settings: Settings, partitions: int = 6) -> str:
    name = f"test.cluster.{uuid.uuid4().hex[:10]}"
    factor, min_isr = replication(settings, brokers=3)
    create_topics(settings, [TopicSpec(name, partitions, factor, {"min.insync.replicas": str(min_isr)})])
    # Creation returns before every node has the new partitions' leaders in its metadata (on a loaded machine a
    # describe right after it listed no leader at all): tests that pick a node by what it leads wait for them.
    wait_for(lambda: sum(n for node, n in partition_leaders(settings, [name]).items() if node > 0)
             == partitions, 30, f"leaders for the {partitions} partitions of {name}")
    return name


def _in_sync(settings: Settings, topic: str, node: int) -> bool:
    admin = make_admin(settings)
    try:
        partitions = admin.describe_topics([topic])[0]["partitions"]
    finally:
        admin.close()
    return bool(partitions) and all(node in p["isr_nodes"] and p["leader_id"] >= 0 for p in partitions)


def _produce(settings: Settings, topic: str, values: range, on_acked=None) -> list[Exception]:
    """Send ``values`` with the pipeline's producer (acks=all, idempotent); the errors of the sends that failed."""
    producer = make_producer(settings)
    errors: list[Exception] = []
    acked = [0]

    def ok(_metadata) -> None:
        acked[0] += 1
        if on_acked:
            on_acked(acked[0])

    try:
        for i in values:
            producer.send(topic, key=str(i).encode(), value=str(i).encode()).add_callback(ok).add_errback(
                errors.append)
            time.sleep(0.001)
        producer.flush(timeout=120)
    finally:
        producer.close(timeout=10)
    return errors


def _read_values(settings: Settings, topic: str, expected: int) -> list[int]:
    records = read_topic(settings, topic, expected=expected, timeout_s=60, idle_s=1, read_committed=True)
    return [int(r.value) for r in records]


def test_topics_and_internal_topics_are_replicated(cluster: Settings) -> None:
    scoped = cluster.model_copy(update={"topics": cluster.topics.model_copy(update={
        name: f"test.cluster.{uuid.uuid4().hex[:8]}.{name}" for name in
        ("documents", "images", "descriptions", "embeddings", "results", "summaries", "deadletter")}
        | {"partitions": 3})})
    create_topics(scoped)
    # A group's offset commit creates __consumer_offsets.
    consumer = make_consumer(scoped, f"test-cluster-{uuid.uuid4().hex[:6]}", [scoped.topics.documents])
    consumer.poll(timeout_ms=2000)
    consumer.commit({})
    consumer.close()
    names = [s.name for s in pipeline_topic_specs(scoped)]
    admin = make_admin(cluster)
    try:
        wait_for(lambda: "__consumer_offsets" in admin.list_topics(), 30, "__consumer_offsets")
        described = {t["name"]: t for t in admin.describe_topics(names + ["__consumer_offsets"])}
        configs = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n)
                                          for n in names + ["__consumer_offsets"]], config_filter="all")["topic"]
        broker_configs = admin.describe_configs([ConfigResource(ConfigResourceType.BROKER, "1")],
                                                config_filter="all")["broker"]["1"]
    finally:
        admin.close()
    for name in names + ["__consumer_offsets"]:
        assert {len(p["replica_nodes"]) for p in described[name]["partitions"]} == {3}, name
        assert configs[name]["min.insync.replicas"]["value"] == "2", name
    assert broker_configs["transaction.state.log.replication.factor"]["value"] == "3"
    assert broker_configs["transaction.state.log.min.isr"]["value"] == "2"
    assert broker_configs["offsets.topic.replication.factor"]["value"] == "3"
    assert active_controller(cluster) in (1, 2, 3)


def test_a_killed_leader_loses_nothing_and_a_node_restored_from_an_older_snapshot_catches_up(
        cluster: Settings) -> None:
    """One scenario, so that the cluster restarts a node twice rather than three times: (1) kill the node leading
    the most partitions while 2,000 records go out with acks=all; every one is acknowledged and read back
    read_committed after the node is restarted. (2) The snapshot of its data taken while it was down lacks what it
    replicated since; restored under it, the node restarts behind the others and catches up."""
    topic = _topic(cluster)
    leaders = partition_leaders(cluster, [topic])
    victim = max((n for n in leaders if n > 0), key=lambda n: leaders[n])
    assert leaders[victim] >= 2
    killed = threading.Event()

    def kill_midway(acked: int) -> None:
        if acked >= 500 and not killed.is_set():
            killed.set()
            threading.Thread(target=kill_node, args=(cluster, victim),
                             kwargs={"reason": "test_cluster: a leader killed mid-produce"}).start()

    errors = _produce(cluster, topic, range(2000), on_acked=kill_midway)
    assert killed.is_set() and errors == []
    wait_for(lambda: node_pids(cluster)[victim] is None, 10, f"node {victim} gone")
    snapshot = snapshot_node_data(cluster, victim)
    assert restart_node(cluster, victim) == node_bootstrap(cluster, victim)
    assert sorted(_read_values(cluster, topic, 2000)) == list(range(2000))
    wait_for(lambda: _in_sync(cluster, topic, victim), 60, f"node {victim} back in sync")

    # (2) In sync, it has the 1,500 records written while it was down; the snapshot has not, nor the 500 more.
    assert _produce(cluster, topic, range(2000, 2500)) == []
    kill_node(cluster, victim, reason="test_cluster: down again, for its older snapshot")
    restore_node_data(cluster, victim, snapshot)
    restart_node(cluster, victim)
    # Back in every partition's ISR: its log reached each leader's end again.
    wait_for(lambda: _in_sync(cluster, topic, victim), 60, f"node {victim} caught up from its snapshot")
    assert sorted(_read_values(cluster, topic, 2500)) == list(range(2500))
    assert all(node_pids(cluster).values())

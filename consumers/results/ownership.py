"""Who aggregates: the results group, the one member that owns all its partitions, and the transactional id that
owner holds (exactly-once). One document's records are spread over the descriptions and dead-letter topics, whose
partitions no assignor can co-locate, so one member reads them all and the others stand by."""

from __future__ import annotations

import threading

from kafka.coordinator.assignors.abstract import (AbstractPartitionAssignor, ConsumerProtocolAssignment,
                                                  ConsumerProtocolSubscription)

from vlmstream.config import Settings


def results_group_id(settings: Settings) -> str:
    return f"{settings.infer.group_id}-results"


def results_transactional_id(group_id: str) -> str:
    """One per aggregator group, whose single owner holds every partition: each new owner fences the one before."""
    return f"{group_id}-txn"


class SingleOwnerAssignor(AbstractPartitionAssignor):
    """Every subscribed partition to one member (the lowest member id); the rest stand by."""

    name = "vlmstream-single-owner"
    version = 0
    # Set when this process, as group leader, assigned a topic it knew no partitions of. kafka-python should then
    # rejoin once metadata arrives, but kafka-python 3.0 can leave the aggregator holding an empty assignment for
    # good; the aggregator checks this and rejoins itself.
    assigned_without_partitions = threading.Event()

    @classmethod
    def assign(cls, cluster, members):
        owner = min(members, key=lambda m: (m.group_instance_id is None, m.group_instance_id or "", m.member_id))
        topics = sorted({t for m in members for t in m.metadata.topics})
        owned = [(t, sorted(cluster.partitions_for_topic(t) or ())) for t in topics]
        if any(not partitions for _, partitions in owned):
            cls.assigned_without_partitions.set()
        return {m.member_id: ConsumerProtocolAssignment(cls.version, owned if m is owner else [], b"")
                for m in members}

    @classmethod
    def metadata(cls, topics):
        return ConsumerProtocolSubscription(cls.version, list(topics), b"")

    @classmethod
    def on_assignment(cls, assignment, generation):
        pass

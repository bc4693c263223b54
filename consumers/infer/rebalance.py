"""The inference runner's rebalance listener: it only tells the runner, through the narrow ``RebalanceTarget``."""

from __future__ import annotations

import logging
from typing import Protocol

from kafka.consumer.subscription_state import AsyncConsumerRebalanceListener

from consumers.infer.engine import EngineDeadError
from vlmstream.kafka.errors import FatalPipelineError

log = logging.getLogger("consumers.infer.runner")


class RebalanceTarget(Protocol):
    """What the listener may tell the runner (``InferenceRunner`` is one)."""

    def rebalance_started(self) -> None: ...

    async def revoke(self, revoked: set) -> None: ...

    def fail(self, exc: BaseException) -> None: ...

    def partitions_assigned(self) -> None: ...

    def drop_partitions(self, lost: set) -> None: ...


class RunnerRebalance(AsyncConsumerRebalanceListener):
    """Drain, flush and commit revoked partitions before the group hands them to another member; forget lost ones.

    kafka-python 3 calls listeners on the consumer's IO thread while the runner's thread waits inside ``poll`` or
    ``close``; a blocking ``consumer.commit`` is refused there (``Checkpoint.commit_from_listener``).
    """

    def __init__(self, runner: RebalanceTarget):
        self.runner = runner

    async def on_partitions_revoked(self, revoked):
        self.runner.rebalance_started()  # eager protocol: every rebalance starts here, with or without partitions
        try:
            await self.runner.revoke(set(revoked))
        except (EngineDeadError, FatalPipelineError) as exc:
            # kafka-python would only log it; the run loop must stop without committing.
            self.runner.fail(exc)

    async def on_partitions_assigned(self, assigned):
        self.runner.partitions_assigned()
        log.info("assigned %s", sorted(f"{tp.topic}/{tp.partition}" for tp in assigned))

    async def on_partitions_lost(self, lost):
        # Membership is already gone: committing would be refused; forget the work and let the next owner redo it.
        self.runner.rebalance_started()
        self.runner.drop_partitions(set(lost))

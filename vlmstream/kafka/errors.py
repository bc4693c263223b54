"""Errors of the Kafka side that decide what a runner does next, in one place."""

from __future__ import annotations

from kafka.errors import CommitFailedError, IllegalGenerationError, RebalanceInProgressError, UnknownMemberIdError


class FatalPipelineError(RuntimeError):
    """The broker or engine is gone: stop without committing (a supervisor restarts the process)."""


# A commit the group refused because it moved on (a rebalance, an eviction): these partitions may be someone else's
# now. Nothing is lost, their new owner redoes what was not committed (duplicates may follow), so a runner logs it
# and goes on.
GROUP_MOVED_ON = (CommitFailedError, IllegalGenerationError, RebalanceInProgressError, UnknownMemberIdError)

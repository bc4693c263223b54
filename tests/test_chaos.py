"""The short chaos run (benchmarks/chaos/run.py): the whole pipeline on a fresh local 3-node cluster, 80 documents,
8 seeded faults (one of each worker fault, a zombie per consumer stage, kill -9 of the
broker leading the most partitions and of the active controller), then the independent checker; fails on any lost image or unplanned dead
letter. The full run (500 documents, 30+ faults, both delivery modes) is the script itself.

Its brokers live under $VLMSTREAM_CHAOS_HOME (default /tmp/vlm-chaos) on ports 29092-29094 (controllers 29142-29144),
apart from the shared broker the other Kafka tests use.
"""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.kafka, pytest.mark.slow]


@pytest.mark.timeout(900)
def test_chaos_short_run_loses_nothing(capsys):
    from benchmarks.chaos.run import BROKER_FAULTS, ChaosRun, parse_args

    mode = os.environ.get("VLMSTREAM_CHAOS_MODE", "at-least-once")
    run = ChaosRun(parse_args(["--docs", "80", "--faults", "8", "--fault-interval-s", "9", "--warmup-s", "15",
                               "--drain-timeout-s", "240", "--mode", mode, "--seed", "2", "--feed-all",
                               # The 80 documents' backlog drains in about a minute: the inference faults go
                               # first, while it may still be in flight, the broker and producer faults last.
                               "--in-order", "--kinds", "kill_infer,zombie_infer,kill_decode_worker,"
                               "kill_decode_fleet,zombie_decode,kill_leader_broker,kill_controller,kill_producer"]))
    code = run.run()
    report = run.report_obj
    assert sum(1 for f in run.faults if f["kind"] in BROKER_FAULTS) >= 1
    assert len(run.faults) >= 8
    assert report.lost == 0, report.render()
    assert not report.unplanned, report.render()
    assert code == 0, report.render()

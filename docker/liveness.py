#!/usr/bin/env python3
"""Liveness of a vlmstream stage, read from its own Prometheus endpoint (``metrics_port``).

Alive while the endpoint answers and, whenever the stage has work (records on its partitions not yet fetched, or
images in its engine), while its work counters move within ``--stall-seconds``. An endpoint that answers is not
enough: it is a thread of its own and keeps answering for a process whose loop is stuck. The last reading is kept
in a file under /tmp between probes.

    vlmstream-liveness 9400 [--stall-seconds 600]     exit 0: alive; 1: stuck or not answering (said on stderr)

Standard library only: it runs in every image, beside whatever the stage installed."""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

# Counters that move when a stage finishes work: decode's documents and dead letters; inference's records
# fetched, images described, dead letters and commits.
WORK = ("vlmstream_decode_documents_total", "vlmstream_decode_errors_total", "vlmstream_infer_records_total",
        "vlmstream_infer_images_described_total", "vlmstream_infer_dead_letters_total",
        "vlmstream_infer_commits_total")
# Gauges that say work is waiting: records not yet fetched, images in the engine.
BACKLOG = ("vlmstream_decode_lag_records", "vlmstream_infer_lag_records", "vlmstream_infer_in_flight")


def readings(text: str) -> tuple[float, float]:
    """(work done, work waiting): the sums of the WORK and BACKLOG samples in a Prometheus text page."""
    work = backlog = 0.0
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        if name in WORK:
            work += value
        elif name in BACKLOG:
            backlog += value
    return work, backlog


def check(port: int, stall_seconds: float, state: Path, now: float) -> str | None:
    """None when alive, else why not."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"metrics endpoint on port {port} does not answer: {exc}"
    work, backlog = readings(text)
    try:
        last = json.loads(state.read_text())
    except (OSError, ValueError):
        last = None
    if last is None or backlog <= 0 or work != last["work"]:
        state.write_text(json.dumps({"work": work, "since": now}))
        return None
    if now - last["since"] > stall_seconds:
        return (f"{backlog:.0f} records or images waiting and no work finished for {now - last['since']:.0f} s "
                f"(--stall-seconds {stall_seconds:.0f})")
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("port", type=int, help="the stage's metrics_port")
    parser.add_argument("--stall-seconds", type=float, default=600.0,
                        help="longest time with work waiting and none finished (default 600)")
    parser.add_argument("--state", type=Path, default=None, help="reading kept between probes")
    args = parser.parse_args(argv)
    state = args.state or Path(f"/tmp/vlmstream-liveness-{args.port}.json")
    problem = check(args.port, args.stall_seconds, state, time.time())
    if problem:
        print(problem, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

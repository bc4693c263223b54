"""docker/liveness.py, the pods' liveness probe, against a real Prometheus endpoint (prometheus_client's server):
alive while work finishes or none waits; stuck once work waits and none finishes for longer than the limit."""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

SCRIPT = Path(__file__).resolve().parents[1] / "docker" / "liveness.py"
spec = importlib.util.spec_from_file_location("liveness_probe", SCRIPT)
liveness = importlib.util.module_from_spec(spec)
spec.loader.exec_module(liveness)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_liveness_follows_work_and_backlog(tmp_path):
    registry = CollectorRegistry()
    described = Counter("vlmstream_infer_images_described", "images", registry=registry)
    lag = Gauge("vlmstream_infer_lag_records", "lag", registry=registry)
    port = _free_port()
    start_http_server(port, addr="127.0.0.1", registry=registry)
    state = tmp_path / "state.json"

    assert liveness.check(port, 60, state, now=1000.0) is None
    assert liveness.check(port, 60, state, now=2000.0) is None  # nothing waits: idle is alive
    lag.set(5)
    assert liveness.check(port, 60, state, now=2030.0) is None  # waiting, within the limit
    problem = liveness.check(port, 60, state, now=2100.0)
    assert problem is not None and "5 records or images waiting" in problem
    described.inc()
    assert liveness.check(port, 60, state, now=2110.0) is None  # work finished: alive again
    assert liveness.check(port, 60, state, now=2160.0) is None
    assert liveness.check(port, 60, state, now=2200.0) is not None
    assert liveness.main([str(_free_port()), "--state", str(tmp_path / "other.json")]) == 1  # nothing answers

"""Stages started side by side on one machine (`vlmstream run`, `estimate`) share its cores: decode yields them
(a higher nice value unless decode.niceness says otherwise) and an engine on the CPU runs one torch thread
(unless infer.cpu_threads or OMP_NUM_THREADS says otherwise)."""

import os
import subprocess
import sys

from vlmstream.cli.run import LOCAL_DECODE_NICENESS, _as_stage
from vlmstream.config import Settings


def test_run_starts_decode_at_the_local_niceness_unless_set():
    assert _as_stage(Settings(), "decode").decode.niceness == LOCAL_DECODE_NICENESS
    assert _as_stage(Settings(), "infer").decode.niceness == 0
    assert _as_stage(Settings(decode={"niceness": 0}), "decode").decode.niceness == 0
    assert _as_stage(Settings(decode={"niceness": 3}), "decode").decode.niceness == 3


def _in_a_fresh_process(code: str) -> subprocess.CompletedProcess:
    """Niceness and torch's threads are per process: each check runs in one of its own."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_decode_worker_applies_its_niceness():
    # The worker's own start-up (consumers.decode.runner._worker_main) raises its nice value before it decodes;
    # run here with a broker nobody answers on and a stop already asked for, so it returns at once.
    code = (
        "import os, multiprocessing as mp\n"
        "from consumers.decode import runner\n"
        "from vlmstream.config import Settings\n"
        "s = Settings(decode={'niceness': 7}, kafka={'bootstrap_servers': '127.0.0.1:1'})\n"
        "stop = mp.Event(); stop.set()\n"
        "before = os.nice(0)\n"
        "try:\n"
        "    runner._worker_main(s, 0, stop, None, None)\n"
        "except BaseException:\n"
        "    pass\n"
        "print(os.nice(0) - before)\n"
    )
    out = _in_a_fresh_process(code)
    assert out.stdout.strip().splitlines()[-1] == "7", out.stderr[-2000:]


def test_run_gives_a_cpu_engine_one_thread_unless_told(monkeypatch):
    from vlmstream.cli.run import LOCAL_INFER_CPU_THREADS

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert _as_stage(Settings(), "infer").infer.cpu_threads == LOCAL_INFER_CPU_THREADS
    assert _as_stage(Settings(infer={"cpu_threads": 2}), "infer").infer.cpu_threads == 2
    assert _as_stage(Settings(), "decode").infer.cpu_threads == 0
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's own choice reaches torch unchanged
    assert _as_stage(Settings(), "infer").infer.cpu_threads == 0


def test_a_cpu_engine_runs_on_the_threads_it_is_given():
    code = (
        "import torch\n"
        "from consumers.infer.engine import limit_cpu_threads\n"
        "torch.set_num_threads(2)\n"
        "limit_cpu_threads(0, 'cpu'); a = torch.get_num_threads()\n"
        "limit_cpu_threads(1, 'cuda'); b = torch.get_num_threads()\n"
        "limit_cpu_threads(1, 'cpu'); print(a, b, torch.get_num_threads())\n"
    )
    out = _in_a_fresh_process(code)
    assert out.stdout.split() == ["2", "2", "1"], out.stderr[-2000:]

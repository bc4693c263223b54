"""Stages started side by side on one machine (`vlmstream run`, `estimate`) share its cores: decode yields them
(a higher nice value unless decode.niceness says otherwise) and an engine on the CPU runs one torch thread
(unless infer.cpu_threads or OMP_NUM_THREADS says otherwise) and at most two malloc arenas
(engine.CPU_MALLOC_ARENAS)."""

import os
import subprocess
import sys

from vlmstream.cli.run_workers import LOCAL_DECODE_NICENESS, as_stage
from vlmstream.config import Settings


def test_run_starts_decode_at_the_local_niceness_unless_set():
    assert as_stage(Settings(), "decode").decode.niceness == LOCAL_DECODE_NICENESS
    assert as_stage(Settings(), "infer").decode.niceness == 0
    assert as_stage(Settings(decode={"niceness": 0}), "decode").decode.niceness == 0
    assert as_stage(Settings(decode={"niceness": 3}), "decode").decode.niceness == 3


def _in_a_fresh_process(code: str) -> subprocess.CompletedProcess:
    """Niceness and torch's threads are per process: each check runs in one of its own."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_decode_worker_applies_its_niceness():
    # The worker's own start-up (consumers.decode.fleet._worker_main) raises its nice value before it decodes;
    # run here with a broker nobody answers on and a stop already asked for, so it returns at once.
    code = (
        "import os, multiprocessing as mp\n"
        "from consumers.decode import fleet\n"
        "from vlmstream.config import Settings\n"
        "s = Settings(decode={'niceness': 7}, kafka={'bootstrap_servers': '127.0.0.1:1'})\n"
        "stop = mp.Event(); stop.set()\n"
        "before = os.nice(0)\n"
        "try:\n"
        "    fleet._worker_main(s, 0, stop, None, None)\n"
        "except BaseException:\n"
        "    pass\n"
        "print(os.nice(0) - before)\n"
    )
    out = _in_a_fresh_process(code)
    assert out.stdout.strip().splitlines()[-1] == "7", out.stderr[-2000:]


def test_run_gives_a_cpu_engine_one_thread_unless_told(monkeypatch):
    from vlmstream.cli.run_workers import LOCAL_INFER_CPU_THREADS

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert as_stage(Settings(), "infer").infer.cpu_threads == LOCAL_INFER_CPU_THREADS
    assert as_stage(Settings(infer={"cpu_threads": 2}), "infer").infer.cpu_threads == 2
    assert as_stage(Settings(), "decode").infer.cpu_threads == 0
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the user's own choice reaches torch unchanged
    assert as_stage(Settings(), "infer").infer.cpu_threads == 0


def test_a_cpu_engine_runs_on_the_threads_it_is_given():
    code = (
        "import torch\n"
        "from consumers.infer.engine import limit_cpu_use\n"
        "from vlmstream.config import InferSettings\n"
        "torch.set_num_threads(2)\n"
        "limit_cpu_use(InferSettings(cpu_threads=0), 'cpu'); a = torch.get_num_threads()\n"
        "limit_cpu_use(InferSettings(cpu_threads=1), 'cuda'); b = torch.get_num_threads()\n"
        "limit_cpu_use(InferSettings(cpu_threads=1), 'cpu'); print(a, b, torch.get_num_threads())\n"
    )
    out = _in_a_fresh_process(code)
    assert out.stdout.split() == ["2", "2", "1"], out.stderr[-2000:]


# Eight threads that allocate at once, then glibc's own count of its arenas (malloc_info writes one <heap> each).
_ARENAS_AFTER_EIGHT_THREADS = """
import ctypes, os, tempfile, threading
from consumers.infer.engine import limit_cpu_use
from vlmstream.config import InferSettings
limit_cpu_use(InferSettings(), {device!r})
barrier = threading.Barrier(8)
def allocate():
    held = [bytearray(4096) for _ in range(64)]
    barrier.wait()
threads = [threading.Thread(target=allocate) for _ in range(8)]
for t in threads: t.start()
for t in threads: t.join()
libc = ctypes.CDLL(None)
libc.fopen.restype = ctypes.c_void_p
path = os.path.join(tempfile.mkdtemp(), 'malloc_info.xml')
fp = libc.fopen(path.encode(), b'w')
libc.malloc_info(0, ctypes.c_void_p(fp)); libc.fclose(ctypes.c_void_p(fp))
print(open(path).read().count('<heap nr='))
"""


def test_a_cpu_engine_caps_its_malloc_arenas(monkeypatch):
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    capped = _in_a_fresh_process(_ARENAS_AFTER_EIGHT_THREADS.format(device="cpu"))
    glibc_default = _in_a_fresh_process(_ARENAS_AFTER_EIGHT_THREADS.format(device="cuda"))  # no cap off the CPU
    assert int(capped.stdout.split()[-1]) <= 2, capped.stderr[-2000:]
    assert int(glibc_default.stdout.split()[-1]) > 2, glibc_default.stderr[-2000:]

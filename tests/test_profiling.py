"""The self-profiler used on the GPU machine: per-thread CPU, sampled Python stacks, child processes."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

from vlmstream.profiling import ThreadProfiler, resident_mb, thread_cpu


def burn_cpu_for_the_profiler(seconds: float) -> None:
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += sum(range(200))


def test_profile_names_the_busy_thread_its_function_and_the_busy_child(tmp_path):
    out = tmp_path / "profile.json"
    profiler = ThreadProfiler(out, interval_s=0.005, window_s=60).start()
    child = subprocess.Popen([sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<3: pass"])
    burner = threading.Thread(target=burn_cpu_for_the_profiler, args=(1.5,), name="burner")
    burner.start()
    burner.join()
    time.sleep(0.1)  # the child is still running: its CPU is counted at the window's end
    profiler.stop()
    child.wait()

    [window] = json.loads(out.read_text())["windows"]
    row = next(t for t in window["threads"] if t["name"] == "burner")
    assert row["cores"] > 0.2, row
    assert row["top_inclusive"][0][0].endswith("burn_cpu_for_the_profiler") or any(
        f.endswith("burn_cpu_for_the_profiler") and share > 0.5 for f, share in row["top_inclusive"]), row
    [busy_child] = [c for c in window["children"] if c["pid"] == child.pid]
    assert busy_child["cores"] > 0.2, window["children"]
    assert window["rss_mb"] > 5 and busy_child["rss_mb"] > 1, (window["rss_mb"], busy_child)


def test_resident_memory_follows_an_allocation():
    import mmap

    before = resident_mb()
    # Fresh pages from the kernel: a bytearray may reuse memory freed earlier in the run that is still resident,
    # and then nothing grows (seen once in CI, after the heavy decode tests).
    block = mmap.mmap(-1, 64 * 1024 * 1024)
    for offset in range(0, len(block), 4096):  # touch every page: resident, not just reserved
        block[offset] = 1
    assert resident_mb() - before > 48
    block.close()
    assert resident_mb(2 ** 22 + 12345) == 0.0  # no such process


def test_thread_cpu_reads_this_process():
    threads = thread_cpu()
    assert threading.main_thread().native_id in threads
    assert all(cpu >= 0 for _, cpu in threads.values())


def test_python_heap_growth_names_the_line_that_keeps_memory(tmp_path):
    """With the Python heap traced, memory a line keeps shows up as growth at that line; without it, no cost."""
    import tracemalloc

    was_tracing = tracemalloc.is_tracing()
    profiler = ThreadProfiler(tmp_path / "p.json", window_s=3600, python_heap=True)
    try:
        profiler._close_window()
        kept = [bytearray(1024) for _ in range(4096)]  # 4 MiB held by this line
        profiler._close_window()
    finally:
        if not was_tracing:
            tracemalloc.stop()
    first, second = profiler.windows
    assert second["python_heap_mb"] - first["python_heap_mb"] > 3.5
    assert second["python_heap_growth"][0]["line"].startswith("test_profiling.py:")
    assert second["python_heap_growth"][0]["kb"] > 3500
    assert len(kept) == 4096
    assert ThreadProfiler(tmp_path / "q.json")._python_heap() == {}

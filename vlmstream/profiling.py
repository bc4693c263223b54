"""Where a process's CPU goes, on machines where no profiler can be installed (the GPU machine).

``VLMSTREAM_PROFILE_OUT=path.json`` makes ``vlmstream infer`` sample itself: every ``window_s`` (60 s) it appends a
window to ``path.json`` (rewritten each time, so a killed process leaves its windows) holding, per thread, the CPU it
used (``/proc/self/task``, so threads of C++ libraries count too) and, for Python threads, how often each function
was on top of its stack and anywhere in it (sampled ``sys._current_frames()`` at ``interval_s``); and the same CPU
account for child processes (vLLM's EngineCore), and each process's resident memory; with
``VLMSTREAM_PROFILE_PYTHON_HEAP=1`` also Python's traced heap and the lines it grew at (tracemalloc). A thread near
1.0 cores is a thread the process waits on; a Python-heavy process near one core *in total* across its Python
threads is bound by its interpreter lock.

Sampling holds the interpreter lock for a moment each time: 50 Hz costs ~1-2% of one core.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import tracemalloc
from collections import Counter
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _stat(path: Path | str) -> tuple[str, list[str]] | None:
    """(name, the fields after it) of a /proc stat file; None when the process or thread is gone. After the name,
    field 0 is the state, 1 the parent pid, 11 and 12 user and system CPU in clock ticks (stat(5) fields 3, 4,
    14, 15)."""
    try:
        text = Path(path).read_text()
    except OSError:
        return None
    return text[text.index("(") + 1: text.rindex(")")], text[text.rindex(")") + 2:].split()


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of one process so far (0 when it is gone)."""
    stat = _stat(f"/proc/{pid}/stat")
    return (int(stat[1][11]) + int(stat[1][12])) / CLOCK_TICKS if stat else 0.0


def resident_mb(pid: int | str = "self") -> float:
    """Resident memory of a process in MiB (VmRSS; 0 when it is gone): a sustained run's memory curve."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    except (OSError, ValueError, IndexError):
        pass
    return 0.0


def thread_cpu(pid: int | str = "self") -> dict[int, tuple[str, float]]:
    """{native thread id: (name, CPU seconds)} of a process's threads, from /proc (empty where there is none)."""
    result = {}
    task_dir = Path(f"/proc/{pid}/task")
    try:
        tids = os.listdir(task_dir)
    except OSError:
        return result
    for tid in tids:
        stat = _stat(task_dir / tid / "stat")
        if stat is not None:  # else the thread ended
            name, fields = stat
            result[int(tid)] = (name, (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    return result


def child_pids(pid: int) -> list[int]:
    """Direct and indirect children of pid (a /proc scan)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        stat = _stat(f"/proc/{entry}/stat") if entry.isdigit() else None
        if stat is not None:
            parents.setdefault(int(stat[1][1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def process_name(pid: int) -> str:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return str(pid)
    return f"{comm}: {' '.join(a.decode(errors='replace') for a in cmdline[:3])}"[:120]


def _frame_name(frame) -> str:
    code = frame.f_code
    return f"{Path(code.co_filename).name}:{code.co_name}"


class ThreadProfiler:
    """Samples this process's Python stacks and its threads' and children's CPU; see the module docstring."""

    def __init__(self, path: str | Path, *, interval_s: float = 0.02, window_s: float = 60.0, top: int = 15,
                 python_heap: bool = False):
        self.path = Path(path)
        self.interval_s, self.window_s, self.top = interval_s, window_s, top
        # tracemalloc slows every Python allocation: only when asked, to tell a Python leak (this grows) from
        # native memory or allocator high water (only the resident size grows).
        self.python_heap = python_heap
        self._heap_first: tracemalloc.Snapshot | None = None
        if python_heap and not tracemalloc.is_tracing():
            tracemalloc.start()
        self.windows: list[dict] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._names: dict[int, tuple[str, int | None]] = {}  # thread ident -> (name, native id), kept after it ends
        self._reset_window()

    def _reset_window(self) -> None:
        self._window_start = time.monotonic()
        self._cpu_start = thread_cpu()
        self._children_start = {pid: thread_cpu(pid) for pid in child_pids(os.getpid())}
        self._cpu_last = dict(self._cpu_start)  # refreshed while sampling: keeps threads that end mid-window
        self._samples = 0
        self._self: dict[int, Counter] = {}
        self._inclusive: dict[int, Counter] = {}

    def start(self) -> "ThreadProfiler":
        self._thread = threading.Thread(target=self._run, name="vlmstream-profiler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        me = threading.get_ident()
        refresh_every = max(1, round(0.2 / self.interval_s))
        while not self._stop.wait(self.interval_s):
            self._sample(me)
            if self._samples % refresh_every == 0:
                self._cpu_last.update(thread_cpu())
                self._names.update({t.ident: (t.name, t.native_id) for t in threading.enumerate()})
            if time.monotonic() - self._window_start >= self.window_s:
                self._close_window()

    def _sample(self, me: int) -> None:
        self._samples += 1
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            self._self.setdefault(ident, Counter())[_frame_name(frame)] += 1
            seen = set()
            while frame is not None:
                seen.add(_frame_name(frame))
                frame = frame.f_back
            self._inclusive.setdefault(ident, Counter()).update(seen)

    def _close_window(self) -> None:
        span = max(1e-9, time.monotonic() - self._window_start)
        self._names.update({t.ident: (t.name, t.native_id) for t in threading.enumerate()})
        native = self._names
        names_by_tid = {tid: name for name, tid in native.values()}
        self._cpu_last.update(thread_cpu())
        cpu_now = self._cpu_last
        threads = []
        for tid, (comm, cpu) in cpu_now.items():
            used = cpu - self._cpu_start.get(tid, (comm, 0.0))[1]
            threads.append({"tid": tid, "name": names_by_tid.get(tid, comm), "cores": round(used / span, 3)})
        for ident, counts in self._self.items():
            name, tid = native.get(ident, (str(ident), None))
            row = next((t for t in threads if t["tid"] == tid), None)
            if row is None:
                row = {"tid": tid, "name": name, "cores": None}
                threads.append(row)
            row["top_self"] = [[f, round(n / self._samples, 3)] for f, n in counts.most_common(self.top)]
            row["top_inclusive"] = [[f, round(n / self._samples, 3)]
                                    for f, n in self._inclusive[ident].most_common(self.top)]
        threads.sort(key=lambda t: -(t["cores"] or 0.0))
        children = []
        for pid in child_pids(os.getpid()):
            before = self._children_start.get(pid, {})
            per_thread = sorted(((name, round((cpu - before.get(tid, (name, 0.0))[1]) / span, 3))
                                 for tid, (name, cpu) in thread_cpu(pid).items()), key=lambda x: -x[1])
            children.append({"pid": pid, "process": process_name(pid), "rss_mb": resident_mb(pid),
                             "cores": round(sum(c for _, c in per_thread), 3), "busiest_threads": per_thread[:5]})
        self.windows.append({"t_end": round(time.time(), 1), "span_s": round(span, 1), "samples": self._samples,
                             "process_cores": round(sum(t["cores"] or 0.0 for t in threads), 3),
                             "rss_mb": resident_mb(), **self._python_heap(),
                             "threads": threads, "children": children})
        self._write()
        self._reset_window()

    def _python_heap(self) -> dict:
        """Python's traced heap now and the lines whose allocations grew most since the first window."""
        if not self.python_heap:
            return {}
        snapshot = tracemalloc.take_snapshot()
        if self._heap_first is None:
            self._heap_first = snapshot
        growth = [{"line": f"{Path(d.traceback[0].filename).name}:{d.traceback[0].lineno}",
                   "kb": round(d.size_diff / 1024, 1)}
                  for d in snapshot.compare_to(self._heap_first, "lineno")[:5] if d.size_diff > 0]
        return {"python_heap_mb": round(tracemalloc.get_traced_memory()[0] / 2 ** 20, 1), "python_heap_growth": growth}

    def _write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "argv": sys.argv[:6], "interval_s": self.interval_s,
                                   "windows": self.windows}, indent=1))
        tmp.replace(self.path)

    def stop(self) -> None:
        """Stop sampling and write what the last, partial window holds."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._samples:
            self._close_window()


def start_from_env() -> ThreadProfiler | None:
    """A started profiler when VLMSTREAM_PROFILE_OUT names a file, else None."""
    path = os.environ.get("VLMSTREAM_PROFILE_OUT")
    if not path:
        return None
    window = float(os.environ.get("VLMSTREAM_PROFILE_WINDOW_S", "60"))
    heap = os.environ.get("VLMSTREAM_PROFILE_PYTHON_HEAP", "") not in ("", "0")
    return ThreadProfiler(path, window_s=window, python_heap=heap).start()

"""How every long-running command stops: one policy for SIGTERM and Ctrl-C, and a worker that dies with its parent.

- The first SIGTERM or SIGINT asks the process to stop: it stops taking work, drains what it holds, flushes and
  commits (the event is set; the command's loop sees it).
- The second stops it now: by default the process exits at once with 128 + the signal's number, nothing more
  committed (the next owner of its partitions redoes what it had not committed). A command that supervises workers
  passes what "now" means for it (``vlmstream run``: kill the workers at once).
- Either way ``reason`` says what stopped it ("SIGTERM", "Ctrl-C", "parent gone"), for its last lines and its exit
  status.

A worker started by another process (``vlmstream run``'s decode, inference and condense workers, the decode fleet's
worker processes) stops when that parent is gone, however it went (SIGKILL included): on Linux the kernel sends it
SIGTERM when its parent dies (``prctl(PR_SET_PDEATHSIG)``); everywhere a watchdog thread sees its parent id change.
Orphaned, it drains like on SIGTERM, but bounded (``ORPHAN_DRAIN_S``): no one waits for it any more.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

# A worker started by a supervisor that should die with it names the supervisor's pid in this variable.
PARENT_PID_VARIABLE = "VLMSTREAM_STOP_WITH_PID"
# How long an orphaned worker may drain before it ends itself (and its own process group): as long as
# `vlmstream run` gives its workers when it stops them.
ORPHAN_DRAIN_S = 180.0
PARENT_WATCH_EVERY_S = 1.0
_PR_SET_PDEATHSIG = 1
SIGNALS = (signal.SIGTERM, signal.SIGINT)


def signal_label(signum: int) -> str:
    return "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def exit_status(signum: int) -> int:
    """The shell's status of a process ended by ``signum``: 143 for SIGTERM, 130 for Ctrl-C."""
    return 128 + signum


class Stop(threading.Event):
    """The stop policy of one process: set once it is asked to stop (a first signal, its parent gone, or
    ``request``); ``now`` runs on a second signal. Pass it wherever a ``threading.Event`` stops a loop."""

    def __init__(self, what: str, *, now: Callable[[int], None] | None = None,
                 on_first: Callable[[str], None] | None = None, orphan_drain_s: float = ORPHAN_DRAIN_S):
        super().__init__()
        self.what = what
        self.signals: list[int] = []
        self.reason: str | None = None
        self._now = now or self._exit_now
        self._on_first = on_first
        self._orphan_drain_s = orphan_drain_s
        self._previous: dict[int, Any] = {}
        self._parent: int | None = None
        self._orphaned = False
        self._lock = threading.RLock()  # a signal handler may take it in the thread that holds it

    # --- installing ---------------------------------------------------------------------------------------------

    def install(self, parent: int | None = None) -> "Stop":
        """Answer SIGTERM and SIGINT with this policy (from the main thread only: Python runs handlers there), and
        stop with ``parent`` (default: the pid in VLMSTREAM_STOP_WITH_PID, if set)."""
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        named = os.environ.pop(PARENT_PID_VARIABLE, "")  # this process's only: its own children have another parent
        if parent is None and named.isdigit():
            parent = int(named)
        if parent is not None:
            self.stop_with_parent(parent)
        return self

    def restore(self) -> None:
        """The handlers there were before ``install``."""
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def __enter__(self) -> "Stop":
        return self.install()

    def __exit__(self, *_exc: object) -> None:
        self.restore()

    # --- asking ---------------------------------------------------------------------------------------------------

    @property
    def at_once(self) -> bool:
        """A second signal came: stop without waiting for anything."""
        return len(self.signals) > 1

    def request(self, reason: str) -> None:
        """Stop as on a first signal, for ``reason`` (a deadline, the end of the input, ...), unless already asked."""
        with self._lock:
            first = self.reason is None
            if first:
                self.reason = reason
        if first:
            self.set()
            if self._on_first is not None:
                self._on_first(reason)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        if signum == signal.SIGTERM and self._parent is not None and os.getppid() != self._parent:
            self.parent_gone()  # the kernel's PR_SET_PDEATHSIG: not a person's second signal
            return
        self.signals.append(signum)
        label = signal_label(signum)
        if len(self.signals) == 1:
            log.warning("%s: %s: stopping; a second SIGTERM or Ctrl-C stops at once", self.what, label)
            self.request(label)
            return
        log.warning("%s: %s again: stopping at once, committing nothing more", self.what, label)
        self._now(signum)

    def _exit_now(self, signum: int) -> None:
        logging.shutdown()
        os._exit(exit_status(signum))

    # --- dying with the parent -----------------------------------------------------------------------------------

    def stop_with_parent(self, parent: int) -> None:
        """Stop (bounded) once ``parent`` is no longer this process's parent."""
        self._parent = parent
        _ask_kernel_for_sigterm_at_parent_death()
        if os.getppid() != parent:  # gone before the kernel was asked
            self.parent_gone()
            return
        threading.Thread(target=self._watch_parent, name="stop-with-parent", daemon=True).start()

    def _watch_parent(self) -> None:
        while os.getppid() == self._parent:
            time.sleep(PARENT_WATCH_EVERY_S)
        self.parent_gone()

    def parent_gone(self) -> None:
        """Drain as on SIGTERM, and end this process (and its process group, if it leads one) after
        ``orphan_drain_s`` whatever it is doing then."""
        with self._lock:
            if self._orphaned:
                return
            self._orphaned = True
        log.warning("%s: its parent (pid %s) is gone: stopping (drain, flush, commit; at most %.0f s)",
                    self.what, self._parent, self._orphan_drain_s)
        timer = threading.Timer(self._orphan_drain_s, _end_now, (self.what, self._orphan_drain_s))
        timer.daemon = True
        timer.start()
        self.request("parent gone")


def _end_now(what: str, after_s: float) -> None:
    log.error("%s: still running %.0f s after its parent went: ending now", what, after_s)
    logging.shutdown()
    if os.getpgrp() == os.getpid():  # its own session's leader: its children (decode workers, an engine) too
        os.killpg(0, signal.SIGKILL)
    os._exit(exit_status(signal.SIGTERM))


def _ask_kernel_for_sigterm_at_parent_death() -> bool:
    """Linux: the kernel sends this process SIGTERM when the thread that started it ends (its parent dies)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False  # the watchdog thread still sees the parent go


def child_environment(env: dict[str, str]) -> dict[str, str]:
    """``env`` for a worker that must stop with this process (its ``Stop.install`` reads it)."""
    return {**env, PARENT_PID_VARIABLE: str(os.getpid())}

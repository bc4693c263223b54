"""Live rates while a job runs: each stage's images done over time, its rate, drift, ETA, and the stage that limits
the run.

Each stage's sustained rate over a sliding window, the first steady window's rate (after the stage first moved:
loading a model is not a rate), drift between the two, and an ETA whose range (and how sure it is, ±%) comes from
the spread of the rate over the window's quarters, wider while the rate covers less than a window.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass
class Eta:
    seconds: float
    low_s: float
    high_s: float

    @property
    def sure(self) -> float:
        """How sure: the range's half-width against the ETA (0.1: within about 10%)."""
        return (self.high_s - self.low_s) / 2 / self.seconds if self.seconds > 0 else 0.0

    def render(self) -> str:
        if self.seconds <= 0:
            return "0 s"
        sure = "?" if math.isinf(self.sure) else f"±{self.sure:.0%}"
        return f"{duration_text(self.seconds)} ({duration_text(self.low_s)}-{duration_text(self.high_s)}, {sure})"


class StageMeter:
    """One stage's count of images done, read every few seconds."""

    def __init__(self, name: str, window_s: float = 60.0):
        self.name = name
        self.window_s = window_s
        self.readings: deque[tuple[float, int]] = deque()
        self.moved_at: float | None = None  # the reading before the count first changed: warm-up ends there
        self.first_steady: float | None = None  # the rate over the first window after moved_at, once it has passed
        self._all: list[tuple[float, int]] = []  # readings since moved_at up to the first window's end

    def restart(self) -> None:
        """Forget every reading: the count went back (a rewound consumer group) and starts again."""
        self.readings.clear()
        self.moved_at = self.first_steady = None
        self._all = []

    def observe(self, at: float, done: int) -> None:
        if self.readings and self.moved_at is None and done != self.readings[-1][1]:
            self.moved_at = self.readings[-1][0]
            self._all = [self.readings[-1]]
        self.readings.append((at, done))
        while len(self.readings) > 2 and at - self.readings[1][0] >= self.window_s:
            self.readings.popleft()
        if self.moved_at is not None and self.first_steady is None:
            self._all.append((at, done))
            if at - self.moved_at >= self.window_s:
                (t0, d0), (t1, d1) = self._all[0], self._all[-1]
                self.first_steady = (d1 - d0) / (t1 - t0)
                self._all = []

    @property
    def done(self) -> int:
        return self.readings[-1][1] if self.readings else 0

    def rate(self) -> float | None:
        """Images per second over the window (from the stage's first move, when that is later); None before it
        moved."""
        span = self._rate_span()
        return None if span is None else (span[1][1] - span[0][1]) / (span[1][0] - span[0][0])

    def rate_seconds(self) -> float | None:
        """The seconds ``rate`` is taken over: the window, or less early in a run (since the stage first moved)."""
        span = self._rate_span()
        return None if span is None else span[1][0] - span[0][0]

    def _rate_span(self) -> tuple[tuple[float, int], tuple[float, int]] | None:
        if self.moved_at is None:
            return None
        points = [(t, d) for t, d in self.readings if t >= self.moved_at]
        if len(points) < 2 or points[-1][0] <= points[0][0]:
            return None
        return points[0], points[-1]

    def rate_spread(self) -> tuple[float, float] | None:
        """(lowest, highest) rate over the window's quarters: how much the rate wanders, for the ETA's range."""
        rate = self.rate()
        if rate is None:
            return None
        points = [(t, d) for t, d in self.readings if t >= (self.moved_at or 0)]
        quarter = self.window_s / 4
        rates = []
        start = points[0]
        for point in points[1:]:
            if point[0] - start[0] >= quarter:
                rates.append((point[1] - start[1]) / (point[0] - start[0]))
                start = point
        if len(rates) < 2:
            # Too few readings to see the spread: ±20% of a whole window's rate, wider the less of a window the
            # rate covers (a rate over a quarter of it is twice as unsure), at most ±60%.
            covered = max(self.rate_seconds() or 0.0, quarter)
            wide = min(0.6, 0.2 * math.sqrt(self.window_s / covered))
            return rate * (1 - wide), rate * (1 + wide)
        return min(rates + [rate]), max(rates + [rate])

    def drift(self) -> float | None:
        """This window's rate against the first steady window's, as a fraction (-0.1: 10% slower)."""
        rate = self.rate()
        if rate is None or not self.first_steady:
            return None
        return rate / self.first_steady - 1

    def eta(self, remaining: int) -> Eta | None:
        rate, spread = self.rate(), self.rate_spread()
        if remaining <= 0:
            return Eta(0.0, 0.0, 0.0)
        if not rate or spread is None:
            return None
        low_rate, high_rate = spread
        return Eta(remaining / rate, remaining / high_rate if high_rate > 0 else math.inf,
                   remaining / low_rate if low_rate > 0 else math.inf)


@dataclass
class StageView:
    """What the bottleneck rule needs of a stage: its rate, and how many images wait at its input beyond what it
    holds in work anyway (``allowance``: an inference window of images being described counts as waiting on the
    topic, but is the stage working, not a queue)."""

    name: str
    rate: float | None
    waiting: int
    allowance: int = 0
    growing: bool = False  # its queue grew over the window: what reaches it outruns it


@dataclass
class Bottleneck:
    stage: str | None
    why: str


def bottleneck(stages: list[StageView]) -> Bottleneck:
    """The stage that limits the run, stages in pipeline order: the last one whose input has a queue (stages after
    it wait for it), and by how much the stage before it outruns it."""
    backed_up = [i for i, s in enumerate(stages) if s.waiting > s.allowance or (s.waiting and s.growing)]
    if not backed_up:
        return Bottleneck(None, "no stage has a queue: the pipeline waits for input")
    i = backed_up[-1]
    stage = stages[i]
    after = [s.name for s in stages[i + 1:]]
    starving = f"; {', '.join(after)} wait{'s' if len(after) == 1 else ''} for it" if after else ""
    before = stages[i - 1] if i > 0 else None
    if before is not None and before.rate and stage.rate:
        how = (f"{before.name} delivers {before.rate:.2f} img/s, {stage.name} takes {stage.rate:.2f} img/s "
               f"({before.rate / stage.rate:.1f}x)")
    elif stage.rate is not None:
        how = f"{stage.waiting} images queued for it at {stage.rate:.2f} img/s"
    else:
        how = f"{stage.waiting} images queued for it, not moving yet"
    return Bottleneck(stage.name, f"{stage.name} limits the run: {how}{starving}")


def progress_line(meter: StageMeter, total: int | None) -> str:
    """``decode  120/400 images  2.31 img/s (60 s)  ETA 2 min (1 min-3 min)  drift -4%``; total None: unknown."""
    rate = meter.rate()
    parts = [f"{meter.name:<9} {meter.done}/{total if total is not None else '?'} images"]
    if total is not None and meter.done >= total:  # an idle window's rate is no slowdown
        return "  ".join([*parts, "done, nothing waits for it" if meter.done else "nothing waits for it"])
    # The seconds the rate covers, not the window's length: early in a run it is taken over less.
    parts.append(f"{rate:.2f} img/s over {meter.rate_seconds():.0f} s" if rate is not None else "not moving yet")
    if total is not None and (eta := meter.eta(total - meter.done)) is not None:
        parts.append(f"ETA {eta.render()}")
    if (drift := meter.drift()) is not None:
        parts.append(f"drift {drift:+.0%} vs first steady window")
    return "  ".join(parts)


def duration_text(seconds: float) -> str:
    """A duration as people read it: seconds below two minutes, minutes below two hours, then hours."""
    if math.isinf(seconds):
        return "?"
    seconds = int(round(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds / 3600:.1f} h"

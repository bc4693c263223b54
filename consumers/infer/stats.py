"""What the inference runner measures of itself, and the warnings it gives when its settings starve the engine."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from consumers.infer.work import InFlightWindow

log = logging.getLogger("consumers.infer.runner")  # operators filter on the runner's logger


@dataclass
class RunnerStats:
    records: int = 0
    described: int = 0
    dead_lettered: int = 0
    dead_letters_by_kind: dict[str, int] = field(default_factory=dict)
    retries: int = 0
    visual_tokens: int = 0
    output_tokens: int = 0
    engine_s: float = 0.0  # described images' time from submission to result, summed
    commits: int = 0
    run_s: float = 0.0
    engine_idle_s: float = 0.0  # wall time with nothing submitted to the engine
    idle_with_work_s: float = 0.0  # ... while records were waiting: the runner, not the input, starved it
    first_record_at: float | None = None  # monotonic
    last_done_at: float | None = None
    idle_after_first_s: float = 0.0
    in_flight_area: float = 0.0  # integral of images in the engine over time, after the first record

    @property
    def engine_idle_fraction(self) -> float:
        return self.engine_idle_s / self.run_s if self.run_s else 0.0

    @property
    def active_s(self) -> float:
        """From the first record fetched to the last one finished: the span where the engine could work."""
        if self.first_record_at is None or self.last_done_at is None:
            return 0.0
        return self.last_done_at - self.first_record_at

    @property
    def active_idle_fraction(self) -> float:
        """Share of ``active_s`` with nothing submitted to the engine (group joins and the idle tail excluded)."""
        if not self.active_s:
            return 0.0
        tail = max(0.0, self.run_s_end - self.last_done_at) if self.last_done_at is not None else 0.0
        return min(1.0, max(0.0, self.idle_after_first_s - tail) / self.active_s)

    run_s_end: float = 0.0

    @property
    def mean_in_flight(self) -> float:
        """Images in the engine on average over the active window: below the batch size, batches run part-empty."""
        return self.in_flight_area / self.active_s if self.active_s else 0.0


class Saturation:
    """Idle time of the engine, and warnings (at most every 30 s each) when the in-flight bounds or the payload
    decoding keep it from being busy."""

    def __init__(self, stats: RunnerStats, *, batch_size: int, step_tokens: int | None, max_tokens: int):
        self.stats = stats
        self.batch_size = batch_size
        self.step_tokens = step_tokens
        self.max_tokens = max_tokens
        self._warned: dict[str, float] = {}
        self._window = [time.monotonic(), 0.0, 0.0]  # start, idle, idle while records waited

    def account(self, dt: float, window: InFlightWindow, engine_pending: int) -> None:
        stats = self.stats
        if stats.first_record_at is not None:
            stats.in_flight_area += dt * len(window.in_flight)
        if engine_pending == 0:
            stats.engine_idle_s += dt
            if stats.first_record_at is not None:
                stats.idle_after_first_s += dt
            self._window[1] += dt
            if window.waiting():
                stats.idle_with_work_s += dt
                self._window[2] += dt

    def warn_static_settings(self, max_images: int) -> None:
        if max_images < self.batch_size:
            log.warning("max_images_in_flight=%d is below the engine's batch size %d: the engine never gets a "
                        "full batch", max_images, self.batch_size)

    def _warn(self, key: str, message: str, *args: Any) -> None:
        t = time.monotonic()
        if t - self._warned.get(key, -1e9) >= 30.0:
            self._warned[key] = t
            log.warning(message, *args)

    def check(self, window: InFlightWindow) -> None:
        in_flight = len(window.in_flight)
        # Few large images can still keep an engine busy: with two steps' worth of visual tokens queued (a 12.8 MP
        # image is ~7,000) vLLM has full prefill steps ahead, however many sequences it could decode at once.
        starved_of_tokens = self.step_tokens is None or window.tokens < 2 * self.step_tokens
        if (window.backlog and in_flight and in_flight < self.batch_size and in_flight < window.max_images
                and starved_of_tokens):
            self._warn("tokens", "max_visual_tokens_in_flight=%d holds only %d image(s), fewer than the engine's "
                       "batch size %d: partitions are paused while the engine could take more",
                       self.max_tokens, in_flight, self.batch_size)
        start, idle, idle_with_work = self._window
        span = time.monotonic() - start
        if span < 10.0:
            return
        if idle_with_work / span > 0.2:
            self._warn("idle", "the engine was idle %.0f%% of the last %.0f s while records waited: payload "
                       "decoding or the in-flight bounds keep it from being busy", 100 * idle_with_work / span,
                       span)
        self._window = [time.monotonic(), 0.0, 0.0]

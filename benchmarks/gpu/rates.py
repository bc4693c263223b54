"""Rates over a phase from the times its images finished: the whole phase, its first and last windows, each whole
minute, and the steady middle. One home for both sides of a ratio: the pipeline's watcher and `vllm serve`'s client
give their completion times here, so their figures mean the same thing."""

from __future__ import annotations


def minute_rates(done: list[float], t0: float, t_end: float) -> list[float]:
    """Images/s in each whole minute from the first publish: the sustained curve of a long run."""
    return [round(sum(1 for t in done if t0 + 60 * i <= t < t0 + 60 * (i + 1)) / 60.0, 2)
            for i in range(int((t_end - t0) // 60))]


def steady_rate(done: list[float], t0: float, t_end: float, window_s: float) -> float | None:
    """Images/s between the end of the first window and the start of the last: the rate with the engine's fill
    (hundreds of requests in flight before the first answer comes back) and a fixed set's drain left out, as a
    sustained stream would see it. None when the phase is too short to have a middle."""
    start, end = t0 + window_s, t_end - window_s
    if end - start < window_s:
        return None
    return round(sum(1 for t in done if start <= t < end) / (end - start), 2)


def phase_rates(done: list[float], t0: float, t_end: float, window_s: float) -> dict:
    """A phase's figures from the times its images finished (``done``), the phase running from ``t0`` (the first
    image sent) to ``t_end`` (the last answer): the window shrinks to a third of a short phase."""
    wall = max(1e-6, t_end - t0)
    win = min(window_s, wall / 3)
    first = sum(1 for t in done if t <= t0 + win)
    last = sum(1 for t in done if t >= t_end - win)
    return {"wall_s": round(wall, 2), "img_per_s": round(len(done) / wall, 2), "window_s": round(win, 1),
            "first_window_img_per_s": round(first / win, 2), "last_window_img_per_s": round(last / win, 2),
            "minute_rates": minute_rates(done, t0, t_end), "steady_img_per_s": steady_rate(done, t0, t_end, win)}

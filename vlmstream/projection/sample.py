"""What a sample run measured: each image's size class and stage times, and the run's timeline (warm-up, then the
steady window).

A sample run gives, per image, each stage's busy time (decode's own CPU milliseconds; inference's batch cost shared
out by tokens: the process's CPU time on the CPU, the batch's wall time on an accelerator) and its size class.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


# Size classes: effective pixels (what the model sees, after the budget) in powers of 4 from 0.05 MP, and source
# pixels likewise (decode's cost follows the source: an 8 MP JPEG costs more to bring to 0.2 MP than a 0.3 MP one).
_CLASS_BASE_PX = 50_000


def size_class(source_px: int | None, effective_px: int | None) -> str:
    """``e2/s4``-like: effective and source pixel bins; ``?`` where the size is not known without decoding."""
    def bin_of(px: int | None) -> str:
        if px is None or px <= 0:
            return "?"
        return str(max(0, int(math.log(max(px, 1) / _CLASS_BASE_PX, 4) + 1)))
    return f"e{bin_of(effective_px)}/s{bin_of(source_px)}"


def class_pixels(name: str) -> tuple[float, float] | None:
    """A class's typical (effective, source) pixels, the geometric middle of its bins; None when unknown."""
    try:
        e, s = (part[1:] for part in name.split("/"))
        return tuple(_CLASS_BASE_PX * 4 ** (int(b) - 0.5) if int(b) > 0 else _CLASS_BASE_PX / 2 for b in (e, s))
    except ValueError:
        return None


@dataclass
class SampleImage:
    """One image of the sample run: its size class, each stage's own time for it, and when each stage finished
    it (seconds on one clock)."""

    size_class: str
    decode_s: float  # decode's own CPU time for it (decode + resize + encode; its wall time where no CPU time is known)
    infer_s: float  # its share of the inference batch it was in (CPU seconds when infer_cpu, else wall seconds)
    done_at: float  # its description written
    decoded_at: float | None = None  # its image record written
    batch: str = ""  # the inference batch it was in
    batch_s: float = 0.0  # that batch's own time (0: an engine without batch times)
    uri: str = ""
    doc_id: str = ""
    infer_cpu: bool = False  # infer_s is the inference process's CPU time (an engine on the CPU reports it)
    decode_cpu: bool = False  # decode_s is the decode thread's CPU time (else its wall time)
    tokens: int = 0  # its visual tokens (0: not known; the batch fit then counts it as one image)


@dataclass
class SampleWindows:
    """The sample run's timeline: warm-up (start-up and model loading) until its first inference batch starts, then
    the steady window to its last description."""

    steady_start: float  # the first batch's start: its description time less its own batch time
    steady_end: float  # the last description's
    warmup_images: int  # described before steady_start (an engine without batch times: the first image)
    decoded_in_warmup: int  # images decoded before steady_start
    decode_exhausted: bool  # decode had finished the whole sample before steady_start (it could have done more)
    decode_rate_warmup: float | None  # images decoded per second before steady_start
    first_decoded_at: float | None = None
    decode_ran_out_at: float | None = None  # when decode ran out of work in the warm-up (None: it did not)

    @property
    def steady_s(self) -> float:
        return self.steady_end - self.steady_start


def sample_windows(images: list[SampleImage], steady_start: float | None = None) -> SampleWindows:
    """The windows of a sample run; ``steady_start`` when the caller knows when the model was ready (else: when the
    first inference batch started)."""
    ordered = sorted(images, key=lambda im: im.done_at)
    first = ordered[0]
    if steady_start is not None:
        start, warm = steady_start, sum(1 for im in ordered if im.done_at <= steady_start)
    elif first.batch_s > 0:
        start, warm = first.done_at - first.batch_s, 0
    else:
        start, warm = first.done_at, 1
    decoded = sorted(im.decoded_at for im in images if im.decoded_at is not None)
    before = [t for t in decoded if t <= start]
    # Decode ran out of work before the model was ready: it decoded the whole sample by then, or (the rest of the
    # sample published at ``steady_start``, a few of its images decoded just before the caller noted the time) it
    # stood idle before start for three of its intervals and at least a second.
    ran_out = None
    if before and len(before) == len(decoded):
        ran_out = before[-1]
    elif steady_start is not None and len(before) >= 2:
        gaps = [(b - a, a) for a, b in zip(before, [*before[1:], start])]
        longest, at = max(gaps)
        busy = [t for t in before if t <= at]
        pace = (busy[-1] - busy[0]) / (len(busy) - 1) if len(busy) >= 2 else None
        if pace is not None and longest > max(1.0, 3 * pace):
            ran_out = at
    done_by = [t for t in before if ran_out is None or t <= ran_out]
    rate = None
    if len(done_by) >= 2 and done_by[-1] > done_by[0]:
        rate = (len(done_by) - 1) / (done_by[-1] - done_by[0])
    return SampleWindows(start, ordered[-1].done_at, warm, len(before), ran_out is not None, rate,
                         decoded[0] if decoded else None, ran_out)


def engine_shares(images: list[SampleImage], windows: SampleWindows) -> tuple[list[SampleImage], bool]:
    """(images, whether their inference costs were converted). An engine that runs hundreds of requests at once
    (vLLM) reports each image's own time in the engine, its latency: 13 s for an image that costs the engine 13 ms
    of its throughput when a thousand are in flight. Such images (no batch of their own) get their share of the
    steady window's wall time instead, shared out over the images described in it in proportion to their engine
    times (a larger image stays longer, so it costs more). The engine is taken as the steady window's limit: if
    decode was, the share overstates inference, and the window's rate, which the projection keeps, says so."""
    if not images or any(im.batch for im in images) or windows.steady_s <= 0:
        return images, False
    inside = sum(im.infer_s for im in images if im.done_at > windows.steady_start)
    if inside <= 0:
        return images, False
    k = windows.steady_s / inside
    return [dataclasses.replace(im, infer_s=im.infer_s * k) for im in images], True


def rate_spread(images: list[SampleImage], after: float) -> float:
    """The relative difference between the rates of the steady window's two halves (images described after
    ``after``); 0.25 when too few images to tell."""
    ordered = sorted(im.done_at for im in images if im.done_at > after)
    if len(ordered) < 6:
        return 0.25
    mid = len(ordered) // 2
    first = mid / max(1e-6, ordered[mid - 1] - after)
    second = (len(ordered) - mid) / max(1e-6, ordered[-1] - ordered[mid - 1])
    return abs(first - second) / ((first + second) / 2)

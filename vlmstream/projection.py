"""How long a job takes: live rates while it runs, and the projection of a whole job from a measured sample.

Pure arithmetic on numbers the callers read (offsets, timestamps, per-image stage times): no Kafka, no stage.
Everything counts images, the unit of work: a document of 40 images is 40 times the work of one of one.

Live (``StageMeter``, ``bottleneck``): each stage's images done over time; its sustained rate over a sliding
window, the first steady window's rate (after the stage first moved: loading a model is not a rate), drift between
the two, and an ETA whose range comes from the spread of the rate over the window's quarters.

Projection (``SampleImage``, ``project``): a sample run gives, per image, each stage's busy time (decode's own
milliseconds, inference's batch time shared out by tokens) and its size class; the sample's steady wall time
calibrates those busy times into wall seconds on this machine. The job's images, counted by size class, times their
class's calibrated cost, plus the sample's fixed cost (start-up, warm-up, stopping), is the prediction.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict, deque
from dataclasses import dataclass, field

# --- live -----------------------------------------------------------------------------------------------------


@dataclass
class Eta:
    seconds: float
    low_s: float
    high_s: float

    def render(self) -> str:
        return f"{_duration(self.seconds)} ({_duration(self.low_s)}-{_duration(self.high_s)})"


class StageMeter:
    """One stage's count of images done, read every few seconds."""

    def __init__(self, name: str, window_s: float = 60.0):
        self.name = name
        self.window_s = window_s
        self.readings: deque[tuple[float, int]] = deque()
        self.moved_at: float | None = None  # the reading before the count first changed: warm-up ends there
        self.first_steady: float | None = None  # the rate over the first window after moved_at, once it has passed
        self._all: list[tuple[float, int]] = []  # readings since moved_at up to the first window's end

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
        if self.moved_at is None:
            return None
        points = [(t, d) for t, d in self.readings if t >= self.moved_at]
        if len(points) < 2:
            return None
        (t0, d0), (t1, d1) = points[0], points[-1]
        return (d1 - d0) / (t1 - t0) if t1 > t0 else None

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
            return rate * 0.8, rate * 1.2  # too few readings to see the spread: a fixed ±20%
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
    parts.append(f"{rate:.2f} img/s over {meter.window_s:.0f} s" if rate is not None else "not moving yet")
    if total is not None and (eta := meter.eta(total - meter.done)) is not None:
        parts.append(f"ETA {eta.render()}")
    if (drift := meter.drift()) is not None:
        parts.append(f"drift {drift:+.0%} vs first steady window")
    return "  ".join(parts)


# --- projection -----------------------------------------------------------------------------------------------

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


def class_pixels(name: str) -> float | None:
    """A class's typical effective pixels (the geometric middle of its bin), for costs of classes not sampled."""
    bin_ = name.split("/")[0][1:]
    if bin_ == "?":
        return None
    b = int(bin_)
    return _CLASS_BASE_PX * 4 ** (b - 0.5) if b > 0 else _CLASS_BASE_PX / 2


@dataclass
class SampleImage:
    """One image of the sample run, as its description reports it."""

    size_class: str
    decode_s: float  # decode's own time for it (fetch + decode + resize + encode)
    infer_s: float  # its share of the inference batch it was in
    done_at: float  # when its description was written (seconds, any clock shared by the sample's images)


@dataclass
class StageCosts:
    """Calibrated wall seconds per image, per size class, on the machine the sample ran on."""

    per_class: dict[str, float]
    decode_share: float  # of the sample's busy time, decode's part
    infer_share: float


@dataclass
class Projection:
    predicted_s: float
    low_s: float
    high_s: float
    images: int
    documents: int
    fixed_s: float  # start-up, warm-up and stopping: measured on the sample, the same for any job size
    steady_s_per_image: float  # the job's mean calibrated cost
    bottleneck: str
    bottleneck_share: float  # the bottleneck stage's part of the busy time
    decode_cores_per_gpu: float | None  # decode processes that keep one inference process busy
    scaled: list[str] = field(default_factory=list)  # what was scaled for --gpus / --decode-cores, and how
    assumptions: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"predicted_s": round(self.predicted_s, 1), "low_s": round(self.low_s, 1),
                "high_s": round(self.high_s, 1), "images": self.images, "documents": self.documents,
                "bottleneck": self.bottleneck, "bottleneck_share": round(self.bottleneck_share, 3),
                "fixed_s": round(self.fixed_s, 1), "steady_s_per_image": round(self.steady_s_per_image, 4),
                "decode_cores_per_gpu": (round(self.decode_cores_per_gpu, 2)
                                         if self.decode_cores_per_gpu is not None else None),
                "scaled": self.scaled, "assumptions": self.assumptions}


def steady_window(images: list[SampleImage], warmup_images: int) -> tuple[list[SampleImage], float]:
    """The images done after the first ``warmup_images`` (the first batch: model loading ends with it), and the wall
    seconds they took (from the last warm-up image's completion to the last image's)."""
    ordered = sorted(images, key=lambda im: im.done_at)
    warm = max(1, min(warmup_images, len(ordered) - 1))
    steady = ordered[warm:]
    return steady, (ordered[-1].done_at - ordered[warm - 1].done_at) if steady else 0.0


def calibrate(steady: list[SampleImage], steady_wall_s: float, *, decode_parallel: float,
              shared_cores: bool) -> StageCosts:
    """Wall seconds per image per class: each image's busy weight (decode's time over its parallel workers, and
    inference's share; summed when both stages share the machine's cores, the larger of the two when they do not),
    scaled so that the steady images' weights add up to the wall time they took."""
    def weight(im: SampleImage) -> float:
        d = im.decode_s / max(decode_parallel, 1.0)
        return d + im.infer_s if shared_cores else max(d, im.infer_s)

    total = sum(weight(im) for im in steady)
    scale = steady_wall_s / total if total > 0 else 0.0
    by_class: dict[str, list[float]] = defaultdict(list)
    for im in steady:
        by_class[im.size_class].append(weight(im) * scale)
    decode_busy = sum(im.decode_s for im in steady)
    infer_busy = sum(im.infer_s for im in steady)
    busy = decode_busy + infer_busy
    return StageCosts({c: statistics.fmean(v) for c, v in by_class.items()},
                      decode_busy / busy if busy else 0.0, infer_busy / busy if busy else 0.0)


def class_cost(costs: StageCosts, name: str) -> tuple[float, str | None]:
    """A class's cost, and a note when it was not sampled: then it is interpolated in effective pixels between
    the sampled classes (linear; the nearest one's cost beyond them), or the sampled mean for an unknown size."""
    if name in costs.per_class:
        return costs.per_class[name], None
    known = sorted((px, c) for c, px in ((c, class_pixels(c)) for c in costs.per_class) if px is not None)
    px = class_pixels(name)
    if px is None or not known:
        mean = statistics.fmean(costs.per_class.values())
        return mean, f"class {name} not sampled: the sample's mean cost used"
    points = [(p, costs.per_class[c]) for p, c in known]
    if px <= points[0][0]:
        return points[0][1], f"class {name} not sampled: the nearest smaller-than-sampled cost used"
    if px >= points[-1][0]:
        p, cost = points[-1]
        return cost * px / p, f"class {name} not sampled: scaled linearly in pixels from class {known[-1][1]}"
    for (p0, c0), (p1, c1) in zip(points, points[1:]):
        if p0 <= px <= p1:
            return c0 + (c1 - c0) * (px - p0) / (p1 - p0), f"class {name} not sampled: interpolated in pixels"
    return statistics.fmean(costs.per_class.values()), None  # not reached


def project(job_classes: dict[str, int], documents: int, costs: StageCosts, fixed_s: float, *,
            steady_rates_spread: float, gpus: int = 1, decode_cores: int | None = None,
            sample_decode_cores: int = 1, measured_infer_per_image_s: float | None = None,
            measured_decode_per_image_s: float | None = None) -> Projection:
    """The whole job: fixed cost + Σ images × their class's calibrated cost, with a range from the spread of the
    sample's steady rate (``steady_rates_spread``: the relative spread of the rate between the sample's halves, at
    least 5%).

    ``gpus`` / ``decode_cores`` (a job meant for more machines than this one): the inference part of the cost is
    divided by gpus (inference processes share nothing), the decode part by decode_cores/sample_decode_cores; the
    wall time is the slower of the two stages' scaled totals, as on separate machines the stages overlap."""
    images = sum(job_classes.values())
    notes = []
    steady = 0.0
    for name, count in sorted(job_classes.items()):
        cost, note = class_cost(costs, name)
        steady += count * cost
        if note:
            notes.append(f"{count} images: {note}")
    scaled = []
    decode_part, infer_part = steady * costs.decode_share, steady * costs.infer_share
    if gpus != 1 or (decode_cores is not None and decode_cores != sample_decode_cores):
        cores = decode_cores if decode_cores is not None else sample_decode_cores * gpus
        decode_scaled = decode_part * sample_decode_cores / cores
        infer_scaled = infer_part / gpus
        scaled.append(f"inference: this machine's measured per-image cost divided by {gpus} GPU(s) "
                      "(one inference process each, nothing shared)")
        scaled.append(f"decode: measured cost per image divided by {cores}/{sample_decode_cores} decode cores "
                      "(decode scales with processes)")
        scaled.append("stages on separate machines overlap: wall time = the slower stage's total, not the sum")
        steady = max(decode_scaled, infer_scaled)
        decode_part, infer_part = decode_scaled, infer_scaled
    share = max(costs.decode_share, costs.infer_share)
    neck = "decode" if decode_part > infer_part else "inference"
    if scaled:
        total_part = decode_part + infer_part
        share = max(decode_part, infer_part) / total_part if total_part else 0.0
    per_gpu = None
    if measured_infer_per_image_s and measured_decode_per_image_s:
        per_gpu = measured_decode_per_image_s / measured_infer_per_image_s
    spread = max(steady_rates_spread, 0.05)
    predicted = fixed_s + steady
    return Projection(
        predicted_s=predicted, low_s=fixed_s + steady * (1 - spread), high_s=fixed_s + steady * (1 + spread),
        images=images, documents=documents, fixed_s=fixed_s,
        steady_s_per_image=steady / images if images else 0.0, bottleneck=neck, bottleneck_share=share,
        decode_cores_per_gpu=per_gpu, scaled=scaled, assumptions=notes)


def _duration(seconds: float) -> str:
    if math.isinf(seconds):
        return "?"
    seconds = int(round(seconds))
    if seconds < 120:
        return f"{seconds} s"
    if seconds < 7200:
        return f"{seconds // 60} min"
    return f"{seconds / 3600:.1f} h"

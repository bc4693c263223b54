"""How long a job takes: live rates while it runs, and the projection of a whole job from a measured sample.

Pure arithmetic on numbers the callers read (offsets, timestamps, per-image stage times): no Kafka, no stage.
Everything counts images, the unit of work: a document of 40 images is 40 times the work of one of one.

Live (``StageMeter``, ``bottleneck``): each stage's images done over time; its sustained rate over a sliding
window, the first steady window's rate (after the stage first moved: loading a model is not a rate), drift between
the two, and an ETA whose range (and how sure it is, ±%) comes from the spread of the rate over the window's
quarters, wider while the rate covers less than a window.

Projection (``SampleImage``, ``project``): a sample run gives, per image, each stage's busy time (decode's own
CPU milliseconds; inference's batch cost shared out by tokens: the process's CPU time on the CPU, the batch's wall
time on an accelerator) and its size class. A batched engine's batch costs a part paid once plus each image's own,
fitted over the sample's batches (``fit_batches``), so a job whose batches run fuller than the sample's
(``batch_occupancy``) pays the fixed part fewer times; the batches' wall time over their cost (the stretch) turns
inference's busy time into wall seconds on this machine, the steady window's wall time decode's. The job's images,
counted by size class, times their class's cost, plus the sample's fixed cost (start-up, warm-up, stopping), is
the prediction; its range comes from what the sample varied in: the steady rate, the class costs' sampling error,
and the machine's other load (``Load``).
"""

from __future__ import annotations

import dataclasses
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
class ClassCosts:
    """Each stage's measured seconds per image by size class (one decode worker, one inference process), and the
    scale that turns the sample's busy seconds into its wall seconds on this machine."""

    decode_s: dict[str, float]
    infer_s: dict[str, float]
    scale: float
    shared_cores: bool
    decode_parallel: float
    cores: int = 1  # the machine's, when the stages share them
    infer_threads: int = 1  # the threads an inference batch runs on
    # infer_s is CPU seconds over all those threads (an engine on the CPU), not wall seconds on them (an
    # accelerator's time, where the process's CPU time says nothing).
    infer_cpu: bool = False
    # infer_s is each image's own part of its batch; a batch also costs per_batch_s whatever it holds, shared by
    # its images: a job whose batches run fuller than the sample's pays it fewer times (``fit_batches``).
    per_batch_s: float = 0.0
    batch_size: int = 0  # the most images a batch may hold (0: the largest the sample ran)
    batches: BatchFit | None = None
    # Inference's batches' wall seconds per second of their cost in the sample: how much the machine stretched the
    # stage the job waits for, measured on every batch (None: no batch times; the window's scale stands in).
    stretch: float | None = None
    # The variance of each class's mean cost (None: one image of the class, nothing to tell it by).
    decode_var: dict[str, float | None] = field(default_factory=dict)
    infer_var: dict[str, float | None] = field(default_factory=dict)

    @property
    def infer_cost(self) -> str:
        return "cpu" if self.infer_cpu else "wall"

    def infer_wall(self, infer_s: float) -> float:
        """Inference's wall seconds on its own threads, each with a core to itself."""
        return infer_s / self.infer_threads if self.infer_cpu else infer_s

    def infer_cpu_s(self, infer_s: float) -> float:
        """Inference's CPU seconds: what it takes of the shared cores."""
        return infer_s if self.infer_cpu else infer_s * self.infer_threads

    def cost(self, name: str) -> tuple[float, float, str | None]:
        """(decode s, inference s, a note when the class was not sampled) for one image of a class."""
        if name in self.decode_s:
            return self.decode_s[name], self.infer_s[name], None
        px = class_pixels(name)
        known = [(class_pixels(c), c) for c in self.decode_s]
        known = [(p, c) for p, c in known if p is not None]
        if px is None or not known:
            return (statistics.fmean(self.decode_s.values()), statistics.fmean(self.infer_s.values()),
                    f"class {name} not sampled: the sample's mean cost")
        # The nearest sampled class, in log pixels; costs scaled linearly in pixels (decode by source pixels,
        # inference by effective pixels), never below the nearest's.
        near_px, near = min(known, key=lambda k: abs(math.log(k[0][0] / px[0])) + abs(math.log(k[0][1] / px[1])))
        d = self.decode_s[near] * max(1.0, px[1] / near_px[1])
        i = self.infer_s[near] * max(1.0, px[0] / near_px[0])
        return d, i, f"class {name} not sampled: from class {near}, scaled up in pixels"

    def wall(self, decode_s: float, infer_s: float, gpus: int = 1, decode_parallel: float | None = None) -> float:
        """Wall seconds for this much busy time. On their own hardware the stages overlap and the slower one sets
        the pace. Sharing the cores, the CPU is a third limit: decode's CPU seconds plus inference's over the cores
        (which also holds inference to the cores when it has more threads than them). Busy times measured as CPU
        time leave out the waiting for a core, so this limit is where the stages' contention for the cores is
        counted, once; the scale holds the rest (other load, what no stage measures)."""
        d = decode_s / (decode_parallel or self.decode_parallel)
        i = self.infer_wall(infer_s) / gpus
        if self.stretch is None:
            if not self.shared_cores:
                return self.scale * max(d, i)
            return self.scale * max(d, i, (decode_s + self.infer_cpu_s(infer_s)) / self.cores)
        # Inference's batches say how much the machine stretched inference (and the cores' sum, which inference's
        # batches ran under); decode's limit keeps the window's scale (a window decode kept busy measures it).
        limits = [self.scale * d, self.stretch * i]
        if self.shared_cores:
            limits.append(self.stretch * (decode_s + self.infer_cpu_s(infer_s)) / self.cores)
        return max(limits)

    def limit(self, decode_s: float, infer_s: float, gpus: int = 1, decode_parallel: float | None = None) -> str:
        """Which of ``wall``'s limits sets the pace: "decode", "inference" or "cores"."""
        d = decode_s / (decode_parallel or self.decode_parallel)
        i = self.infer_wall(infer_s) / gpus
        both = (decode_s + self.infer_cpu_s(infer_s)) / self.cores if self.shared_cores else 0.0
        decode_k, infer_k = self.scale, self.stretch if self.stretch is not None else self.scale
        return max((decode_k * d, "decode"), (infer_k * i, "inference"), (infer_k * both, "cores"))[1]


def _mean_by_class(images: list[SampleImage], attr: str) -> dict[str, float]:
    by: dict[str, list[float]] = defaultdict(list)
    for im in images:
        by[im.size_class].append(getattr(im, attr))
    return {c: statistics.fmean(v) for c, v in by.items()}


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


def calibrate(images: list[SampleImage], windows: SampleWindows, *, decode_parallel: float,
              shared_cores: bool, cores: int = 1, infer_threads: int = 1, batch_size: int = 0) -> ClassCosts:
    """Per-class stage costs from every sample image, and the scale from the steady window: the busy time of what
    was done inside it (images decoded and images described there) against its wall time. Inference's costs are
    CPU time when every image's is (one engine runs the whole sample). A batched engine's costs are split into the
    part each batch pays once and each image's own (``fit_batches``), and its batches' wall over their cost is the
    stretch inference's limit is calibrated by (``ClassCosts.wall``). Inference's costs come from the steady
    window's batches where it ran three or more: the batches of the warm-up pay first-call costs a run pays once
    (a class seen only there keeps its cost from them)."""
    steady = [im for im in images if im.done_at > windows.steady_start]
    if len({im.batch for im in steady if im.batch}) < 3:
        steady = images
    fit = fit_batches(steady)
    own = _own_parts(steady, fit.per_batch_s)
    infer_s = _mean_by_class(own, "infer_s")
    rest = [im for im in _own_parts(images, fit.per_batch_s) if im.size_class not in infer_s]
    infer_s.update(_mean_by_class(rest, "infer_s"))
    infer_var = _var_of_mean_by_class(own, "infer_s")
    infer_var.update(_var_of_mean_by_class(rest, "infer_s"))
    costs = ClassCosts(_mean_by_class(images, "decode_s"), infer_s, 1.0, shared_cores,
                       decode_parallel, cores, infer_threads, infer_cpu=all(im.infer_cpu for im in images),
                       per_batch_s=fit.per_batch_s, batch_size=batch_size, batches=fit,
                       decode_var=_var_of_mean_by_class(images, "decode_s"),
                       infer_var=infer_var)
    inside = [im for im in images if im.done_at > windows.steady_start]
    decoded = [im for im in images if im.decoded_at is not None and im.decoded_at > windows.steady_start]
    busy = costs.wall(sum(im.decode_s for im in decoded), sum(im.infer_s for im in inside))
    costs.scale = windows.steady_s / busy if busy > 0 and windows.steady_s > 0 else 1.0
    costs.stretch = fit.stretch
    return costs


@dataclass
class BatchFit:
    """A batched engine's batches as the sample ran them. A batch costs a part it pays once whatever it holds (the
    generation loop's steps, the engine's own overhead) plus each image's own part; a sample whose images trickle in
    runs emptier batches than a job with a queue, so the per-image cost it saw depends on how full they were."""

    per_batch_s: float  # the part paid once per batch, in the costs' unit (CPU s or wall s)
    batches: int
    mean_images: float  # the sample's batches' mean images
    largest: int
    stretch: float | None  # the batches' wall s over their cost s (None: costs are wall time, or no batch times)
    fitted: bool  # False: the batches were too alike (or too few) to tell the two parts apart; per_batch_s is 0
    # How much that stretch wandered from batch to batch (its relative standard deviation): the machine's other
    # work coming and going while the sample ran, which a run meets too.
    wander: float = 0.0

    def said(self) -> str:
        if not self.batches:
            return "no batches of its own (an engine that runs requests at once): each image its share of the window"
        fill = (f"the sample's {self.batches} batches held {self.mean_images:.1f} images on average (at most "
                f"{self.largest})")
        if not self.fitted:
            return f"{fill}; too alike to tell a batch's fixed part from its images': costs taken per image as they were"
        return f"{fill}; a batch's cost fitted as {self.per_batch_s * 1000:.0f} ms per batch plus each image's own"


def fit_batches(images: list[SampleImage]) -> BatchFit:
    """The part of a batch's cost paid once per batch, by least squares of each batch's cost on its images (weighted
    by visual tokens where known) over the sample's batches; 0 where they do not differ enough to tell (fewer than
    3 batches, or fewer than 2 sizes). Never below 0 nor above 90% of the cheapest batch's cost."""
    groups: dict[str, list[SampleImage]] = defaultdict(list)
    for im in images:
        if im.batch:
            groups[im.batch].append(im)
    if not groups:
        return BatchFit(0.0, 0, 1.0, 1, None, False)
    tokens_known = all(im.tokens > 0 for im in images)
    mean_tokens = statistics.fmean(im.tokens for im in images) if tokens_known else 1.0
    rows = []  # (weight, cost, wall, images) per batch
    for members in groups.values():
        weight = sum(im.tokens / mean_tokens if tokens_known else 1.0 for im in members)
        rows.append((weight, sum(im.infer_s for im in members), members[0].batch_s, len(members)))
    total_cost = sum(r[1] for r in rows)
    stretch, wander = None, 0.0
    if all(im.infer_cpu for im in images) and total_cost > 0 and all(r[2] > 0 for r in rows):
        stretch = sum(r[2] for r in rows) / total_cost
        each = [r[2] / r[1] for r in rows if r[1] > 0]
        wander = statistics.pstdev(each) / statistics.fmean(each) if len(each) >= 2 else 0.0
    mean_images = statistics.fmean(r[3] for r in rows)
    largest = max(r[3] for r in rows)
    if len(rows) < 3 or len({r[3] for r in rows}) < 2:
        return BatchFit(0.0, len(rows), mean_images, largest, stretch, False, wander)
    xs, ys = [r[0] for r in rows], [r[1] for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    per_batch = min(max(0.0, my - slope * mx), 0.9 * min(ys))
    return BatchFit(per_batch, len(rows), mean_images, largest, stretch, True, wander)


def _own_parts(images: list[SampleImage], per_batch_s: float) -> list[SampleImage]:
    """Each image's cost less its share of its batch's fixed part (in proportion to its cost in the batch)."""
    if per_batch_s <= 0:
        return images
    totals: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for im in images:
        totals[im.batch] += im.infer_s
        counts[im.batch] += 1
    out = []
    for im in images:
        if not im.batch:
            out.append(im)
            continue
        share = im.infer_s / totals[im.batch] if totals[im.batch] > 0 else 1 / counts[im.batch]
        out.append(dataclasses.replace(im, infer_s=max(0.0, im.infer_s - per_batch_s * share)))
    return out


def _var_of_mean_by_class(images: list[SampleImage], attr: str) -> dict[str, float | None]:
    by: dict[str, list[float]] = defaultdict(list)
    for im in images:
        by[im.size_class].append(getattr(im, attr))
    return {c: statistics.variance(v) / len(v) if len(v) > 1 else None for c, v in by.items()}


@dataclass
class Projection:
    predicted_s: float
    low_s: float
    high_s: float
    images: int
    documents: int
    fixed_s: float  # start-up, warm-up and stopping: measured on the sample, the same for any job size
    steady_s: float
    bottleneck: str
    bottleneck_share: float  # the bottleneck stage's part of the job's busy time
    decode_cores_per_gpu: float | None  # decode processes that keep one inference process busy
    scaled: list[str] = field(default_factory=list)  # what was scaled for --gpus / --decode-cores, and how
    assumptions: list[str] = field(default_factory=list)
    batch_images: float | None = None  # the images a batch of the job holds, as projected (None: no batches)
    range_parts: dict[str, float] = field(default_factory=dict)  # each source of the range, as a relative width

    def as_dict(self) -> dict:
        return {"predicted_s": round(self.predicted_s, 1), "low_s": round(self.low_s, 1),
                "high_s": round(self.high_s, 1), "images": self.images, "documents": self.documents,
                "batch_images": round(self.batch_images, 2) if self.batch_images is not None else None,
                "range_parts": {k: round(v, 3) for k, v in self.range_parts.items()},
                "bottleneck": self.bottleneck, "bottleneck_share": round(self.bottleneck_share, 3),
                "fixed_s": round(self.fixed_s, 1), "steady_s": round(self.steady_s, 1),
                "decode_cores_per_gpu": (round(self.decode_cores_per_gpu, 2)
                                         if self.decode_cores_per_gpu is not None else None),
                "scaled": self.scaled, "assumptions": self.assumptions}


def contended_warmup(warmup_s: float, decode_busy_s: float, *, cores: int, decode_parallel: float,
                     decode_niceness: int = 0) -> float:
    """The warm-up (loading the model) of a job whose decoding lasts through all of it, from a sample's whose decoding
    lasted ``decode_busy_s`` of its ``warmup_s``: on shared cores, loading gets a core while decode is idle and its
    share of the cores while decode works (the same loading work, spread thinner): the scheduler weighs a process
    at nice n about 1.25^-n of one at nice 0, so decode at nice 10 takes little from it."""
    decode_weight = 1.25 ** -decode_niceness
    contended = min(1.0, cores / (1 + decode_parallel * decode_weight))
    busy = min(max(decode_busy_s, 0.0), warmup_s)
    work = busy * contended + (warmup_s - busy)
    return work / contended


@dataclass
class Load:
    """The machine's other work: the load average (1 min) read before and after the sample, on ``cores``."""

    before: float
    after: float
    cores: int
    own: float = 0.0  # what the sample's own processes added to ``after`` (the 1-min average counts them too)

    def contention(self, other: float, own: float) -> float:
        """How much longer CPU work takes with ``other`` runnable processes beside the job's ``own``: not at all
        while they fit the cores, then in proportion to them."""
        return max(1.0, (max(other, 0.0) + own) / self.cores)

    def moves(self) -> float:
        """How far the other load may move during the job: what it moved during the sample, at least half a core."""
        return max(0.5, abs(self.after - self.own - self.before))

    @staticmethod
    def sample_share(busy_s: float, span_s: float) -> float:
        """What a sample whose processes were busy ``busy_s`` CPU seconds over ``span_s`` adds to the 1-min load
        average at its end: its mean busy processes, weighted as the kernel's exponential average weights the last
        ``span_s`` of the minute."""
        if span_s <= 0:
            return 0.0
        return busy_s / span_s * (1 - math.exp(-span_s / 60))


def batch_occupancy(costs: ClassCosts, decode_s: float, infer_s: float, *, gpus: int = 1,
                    decode_parallel: float | None = None) -> float:
    """The images a batch of the job holds, for an image's decode ``decode_s`` and inference ``infer_s`` (its own
    part). An engine takes what is queued, up to its batch size: with decode ahead of it, every batch is full; with
    decode behind, a batch holds what decode delivered while the last one ran, and a fuller batch runs longer:
    k = r * (a + k * m) * stretch (r decode's rate, a the batch's fixed part, m an image's own), solved for k."""
    largest = costs.batch_size or (costs.batches.largest if costs.batches else 1)
    a = costs.per_batch_s
    if a <= 0 or largest <= 1:
        return float(largest)
    k_stretch = ((costs.stretch if costs.stretch is not None else costs.scale)
                 / (costs.infer_threads if costs.infer_cpu else 1) / gpus)
    decode_rate = ((decode_parallel or costs.decode_parallel) / (costs.scale * decode_s) if decode_s > 0
                   else math.inf)
    if decode_rate >= largest / ((a + largest * infer_s) * k_stretch):
        return float(largest)
    room = 1 - decode_rate * infer_s * k_stretch
    k = decode_rate * a * k_stretch / room if room > 0 else largest
    return float(min(largest, max(1.0, k)))


def project(job_classes: dict[str, int], documents: int, costs: ClassCosts, windows: SampleWindows,
            fixed_s: float, *, spread: float, gpus: int = 1, decode_cores: int | None = None,
            warmup_extra_s: float = 0.0, load: Load | None = None) -> Projection:
    """The whole job's wall time: the fixed part measured on the sample (start-up, model loading, results and
    stopping) plus the job's remaining busy time in wall seconds.

    What the fixed part already holds is taken off the job: the first batch's inference, and the decoding done
    while the model loaded (the sample's count; when the sample ran out of documents to decode before the model was
    ready, what decode's rate would have done in that time). A batched engine's images cost their own part plus
    their batch's fixed part over the images the job's batches hold (``batch_occupancy``), not the sample's.

    The range, from what the sample varied in: the steady rate's spread (``spread``, 5% to 50%: the window's halves
    and its number of batches), the sampling error of the job's costs (twice the standard error of the class means
    that the limiting stage's total is made of), how much the machine stretched inference's batches differently from
    one batch to the next (the other work coming and going: on the fixed part too, model loading is CPU work) and,
    with ``load`` on shared cores, the machine's other work moving by as much as it moved during the sample (at
    least half a core) while the job runs.

    ``warmup_extra_s``: how much longer the job's warm-up is than the sample's (``contended_warmup``).

    ``gpus`` / ``decode_cores`` (a job meant for more than this machine): inference time divided by gpus (one
    process each, nothing shared), decode time by the decode processes; stages on their own cores overlap."""
    images = sum(job_classes.values())
    notes = []
    decode_total = infer_total = decode_var = infer_var = 0.0
    for name, count in sorted(job_classes.items()):
        d, i, note = costs.cost(name)
        decode_total += count * d
        infer_total += count * i
        decode_var += count ** 2 * _class_var(costs.decode_var, name, d, costs.decode_s)
        infer_var += count ** 2 * _class_var(costs.infer_var, name, i, costs.infer_s)
        if note:
            notes.append(f"{count} images: {note}")
    mean_d = decode_total / images if images else 0.0
    mean_i = infer_total / images if images else 0.0
    scaled = []
    parallel = costs.decode_parallel
    if gpus != 1 or (decode_cores is not None and decode_cores != costs.decode_parallel):
        parallel = decode_cores if decode_cores is not None else costs.decode_parallel * gpus
        scaled.append(f"inference: measured seconds per image here divided by {gpus} GPU(s) (one inference "
                      "process each, nothing shared)")
        scaled.append(f"decode: measured seconds per image on one worker divided by {parallel:g} decode processes "
                      f"(here {costs.decode_parallel:g})")
        if costs.shared_cores:
            scaled.append("stages on separate machines overlap: the slower stage's total sets the time, where here "
                          "(one machine's cores) they add up")
        costs = dataclasses.replace(costs, shared_cores=False, decode_parallel=parallel)
    occupancy = None
    if costs.batches is not None and costs.batches.batches:
        occupancy = batch_occupancy(costs, mean_d, mean_i, gpus=gpus, decode_parallel=parallel)
        infer_total += images * costs.per_batch_s / occupancy
        mean_i = infer_total / images if images else 0.0
        full = occupancy >= (costs.batch_size or costs.batches.largest)
        notes.append(f"{costs.batches.said()}; the job's batches hold {occupancy:.1f}"
                     + (" (full: decode keeps ahead of inference)" if full
                        else " (what decode delivers while a batch runs)"))
    free_decoded = windows.decoded_in_warmup
    if windows.decode_exhausted and windows.decode_rate_warmup and windows.first_decoded_at is not None:
        # Decode ran out of sample before the model was ready: the job keeps it busy all that time (and the longer
        # warm-up that its decoding causes, warmup_extra_s).
        span = windows.steady_start - windows.first_decoded_at + warmup_extra_s
        free_decoded = max(free_decoded, int(1 + windows.decode_rate_warmup * span))
    free_decoded = min(images, free_decoded)
    decode_left = max(0.0, decode_total - free_decoded * mean_d)
    infer_left = max(0.0, infer_total - min(images, windows.warmup_images) * mean_i)
    steady = costs.wall(decode_left, infer_left, gpus=gpus, decode_parallel=parallel)
    fixed = fixed_s + warmup_extra_s
    d_part, i_part = decode_left / parallel, costs.infer_wall(infer_left) / gpus
    neck = "decode" if d_part > i_part else "inference"
    share = max(d_part, i_part) / (d_part + i_part) if d_part + i_part else 0.0
    # The range's parts, each a relative width.
    spread = min(max(spread, 0.05), 0.5)
    limit = costs.limit(decode_left, infer_left, gpus=gpus, decode_parallel=parallel)
    total, var = {"decode": (decode_total, decode_var), "inference": (infer_total, infer_var)}.get(
        limit, (decode_total + infer_total, decode_var + infer_var))
    sampling = min(0.5, 2 * math.sqrt(var) / total) if total > 0 else 0.0
    wander = min(0.5, costs.batches.wander) if costs.batches is not None else 0.0
    width = math.hypot(spread, sampling, wander)
    parts = {"steady_rate": spread, "sampled_costs": sampling, "machine_wander": wander}
    up = down = 1.0
    if load is not None and costs.shared_cores:
        # The job's own busy processes: inference's threads and decode's share of its processes over the steady part.
        own = costs.infer_threads + min(parallel, decode_left / steady if steady > 0 else 0.0)
        here = load.contention(load.before, own)
        up = load.contention(load.before + load.moves(), own) / here
        down = load.contention(load.before - load.moves(), own) / here
        parts["load_up"], parts["load_down"] = up - 1, 1 - down
        notes.append(f"the machine's other work stays near a load average of {load.before:.1f} (before the sample; "
                     f"{load.after:.1f} after it, on {load.cores} cores, the job keeping about {own:.1f} busy): "
                     f"{load.moves():.1f} more busy processes make the run {up - 1:.0%} longer, "
                     f"{load.moves():.1f} fewer {1 - down:.0%} shorter; the range covers both")
    return Projection(
        predicted_s=fixed + steady, low_s=(fixed / (1 + wander) + steady / (1 + width)) * down,
        high_s=(fixed * (1 + wander) + steady * (1 + width)) * up,
        images=images, documents=documents, fixed_s=fixed, steady_s=steady, bottleneck=neck, bottleneck_share=share,
        decode_cores_per_gpu=mean_d / costs.infer_wall(mean_i) if mean_i else None, scaled=scaled, assumptions=notes,
        batch_images=occupancy, range_parts=parts)


def _class_var(variances: dict[str, float | None], name: str, cost: float, means: dict[str, float]) -> float:
    """The variance of a class's mean cost; for a class seen once (or not at all), the sample's typical relative
    variance of a class mean applied to its cost (one image says nothing of its class's spread)."""
    known = variances.get(name)
    if known is not None:
        return known
    relative = [v / means[c] ** 2 for c, v in variances.items() if v is not None and means.get(c)]
    return cost ** 2 * (statistics.fmean(relative) if relative else 0.25)


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

"""The cost model fitted on a sample: each stage's seconds per image by size class, and how they turn into wall
seconds on this machine.

A batched engine's batch costs a part paid once plus each image's own, fitted over the sample's batches
(``fit_batches``); the batches' wall time over their cost (the stretch) turns inference's busy time into wall seconds
on this machine, the steady window's wall time decode's (``calibrate``, ``ClassCosts.wall``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from vlmstream.projection.sample import SampleImage, SampleWindows, class_pixels


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


def calibrate(images: list[SampleImage], windows: SampleWindows, *, decode_parallel: float,
              shared_cores: bool, cores: int = 1, infer_threads: int = 1, batch_size: int = 0) -> ClassCosts:
    """Per-class stage costs from every sample image, and the scale from the steady window: the busy time of what
    was done inside it (images decoded and images described there) against its wall time. Inference's costs are
    CPU time when every image's is (one engine runs the whole sample). A batched engine's costs are split into the
    part each batch pays once and each image's own (``fit_batches``), and its batches' wall over their cost is the
    stretch inference's limit is calibrated by (``ClassCosts.wall``). Inference's costs come from the steady
    window's batches where it ran three or more: the batches of the warm-up pay first-call costs a run pays once
    (a class seen only there keeps its cost from them). An engine that shares out (no batches of its own) likewise
    takes its costs from the images described in the steady window, where three or more were: the first wave,
    described as the model came up, waited through its start, and its shares say so."""
    steady = [im for im in images if im.done_at > windows.steady_start]
    batched = any(im.batch for im in images)
    if (len({im.batch for im in steady if im.batch}) if batched else len(steady)) < 3:
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

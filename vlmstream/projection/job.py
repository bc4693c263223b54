"""A whole job's wall time and its range, projected from the sample's cost model.

The job's images, counted by size class, times their class's cost, plus the sample's fixed cost (start-up, warm-up,
stopping), is the prediction; a job whose batches run fuller than the sample's (``batch_occupancy``) pays a batch's
fixed part fewer times. Its range comes from what the sample varied in: the steady rate, the class costs' sampling
error, and the machine's other load (``Load``).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass, field

from vlmstream.projection.costs import ClassCosts
from vlmstream.projection.sample import SampleWindows


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
            warmup_extra_s: float = 0.0, load: Load | None = None,
            images_range: tuple[int, int] | None = None, cached_compile_s: float = 0.0) -> Projection:
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

    ``cached_compile_s``: the seconds the sample's start spent compiling the model into a cache that the job's
    start on this machine loads instead: off the point estimate, kept in the range's top (a machine without it).

    ``images_range``: the fewest and most images the job may hold where its count is partly assumed (remote PDFs
    whose pages were not counted): the range's steady part shrinks and grows with them.

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
    fixed = fixed_s + warmup_extra_s - cached_compile_s
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
    fewer = more = 1.0
    if images_range is not None and images:
        fewer, more = min(1.0, images_range[0] / images), max(1.0, images_range[1] / images)
        parts["images_down"], parts["images_up"] = 1 - fewer, more - 1
    return Projection(
        predicted_s=fixed + steady, low_s=(fixed / (1 + wander) + steady * fewer / (1 + width)) * down,
        high_s=((fixed + cached_compile_s) * (1 + wander) + steady * more * (1 + width)) * up,
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

"""The projection maths (vlmstream/projection/), on numbers made up to have known answers: the live meters
(sliding-window rate, warm-up left out, drift, ETA range), the bottleneck rule, and the estimate's projection of a
whole job from a sample (size classes, warm-up taken off, scaling to more GPUs and decode cores)."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from vlmstream.projection.costs import calibrate
from vlmstream.projection.job import project
from vlmstream.projection.live import StageMeter, StageView, bottleneck, progress_line
from vlmstream.projection.sample import (
    SampleImage,
    class_pixels,
    engine_shares,
    rate_spread,
    sample_windows,
    size_class,
)


def test_a_meter_leaves_warm_up_out_of_its_rate_and_reports_drift_against_the_first_steady_window():
    meter = StageMeter("inference", window_s=20)
    for t in range(0, 30, 5):  # 30 s of loading: nothing moves
        meter.observe(t, 0)
    assert meter.rate() is None and meter.eta(100) is None
    done = 0
    for t in range(30, 60, 5):  # 2 img/s
        done += 10
        meter.observe(t, done)
        if t == 40:  # 15 s after the last reading before the first move: the rate covers those, not a 20-s window
            assert progress_line(meter, 1000).count("2.00 img/s over 15 s") == 1
    assert meter.rate() == pytest.approx(2.0, rel=0.01)
    assert meter.first_steady == pytest.approx(2.0, rel=0.01)
    for t in range(60, 100, 5):  # slows to 1 img/s
        done += 5
        meter.observe(t, done)
    assert meter.rate() == pytest.approx(1.0, rel=0.01)
    assert meter.drift() == pytest.approx(-0.5, rel=0.02)
    eta = meter.eta(100)
    assert eta.seconds == pytest.approx(100, rel=0.02) and eta.low_s <= eta.seconds <= eta.high_s
    line = progress_line(meter, done + 100)
    assert f"{done}/{done + 100} images" in line and "drift -50%" in line and "ETA" in line
    assert "img/s over 20 s" in line


def test_the_bottleneck_is_the_last_stage_with_a_queue_and_says_by_how_much():
    neck = bottleneck([StageView("decode", 3.0, 5), StageView("inference", 1.0, 400, allowance=256)])
    assert neck.stage == "inference" and "3.0x" in neck.why
    neck = bottleneck([StageView("decode", 0.5, 300), StageView("inference", 0.5, 10, allowance=256)])
    assert neck.stage == "decode" and "inference waits for it" in neck.why
    # A queue inside the inference window that keeps growing is a queue too.
    neck = bottleneck([StageView("decode", 3.0, 0), StageView("inference", 1.0, 100, allowance=256, growing=True)])
    assert neck.stage == "inference"
    assert bottleneck([StageView("decode", 1.0, 0), StageView("inference", 1.0, 0)]).stage is None


def test_size_classes_bin_pixels_by_fours():
    assert size_class(100_000, 100_000) == "e1/s1"
    assert size_class(16_000_000, 400_000) == "e2/s5"
    assert size_class(None, None) == "e?/s?"
    effective, source = class_pixels("e2/s5")
    assert 200_000 < effective < 800_000 and 12_800_000 < source < 51_200_000
    assert class_pixels("e?/s?") is None


def _sample(batches: list[list[tuple[str, float, float]]], start: float = 100.0, every_s: float = 2.0):
    """Images of successive batches, each batch finishing every_s after the last; decode done just before."""
    out = []
    for b, batch in enumerate(batches):
        done = start + b * every_s
        for name, decode_s, infer_s in batch:
            out.append(SampleImage(name, decode_s, infer_s, done, decoded_at=done - 1.0, batch=f"b{b}",
                                   batch_s=every_s))
    return out


def test_a_projection_costs_each_size_class_and_takes_warm_up_off():
    # Small images: 0.25 s of inference each, large ones 0.75 s; batches of 4 every 2 s, then 3 s.
    small, large = ("e1/s1", 0.0, 0.25), ("e2/s5", 0.0, 0.75)
    images = _sample([[small] * 4, [small] * 4], every_s=1.0) + _sample([[large] * 4] * 2, start=104.0, every_s=3.0)
    windows = sample_windows(images)
    # Warm-up ends when the first batch starts (its description time less its batch time): 99 s.
    assert windows.warmup_images == 0 and windows.steady_start == pytest.approx(99.0)
    assert windows.steady_s == pytest.approx(107.0 - 99.0)
    costs = calibrate(images, windows, decode_parallel=1, shared_cores=True)
    assert costs.infer_s == {"e1/s1": 0.25, "e2/s5": 0.75}
    assert costs.scale == pytest.approx(8.0 / (8 * 0.25 + 8 * 0.75))  # wall s per busy s in the steady window
    job = project({"e1/s1": 40, "e2/s5": 40}, 20, costs, windows, fixed_s=30.0 - windows.steady_s, spread=0.1)
    assert job.fixed_s == pytest.approx(30.0 - 8.0)
    assert job.predicted_s == pytest.approx(22.0 + costs.scale * (40 * 0.25 + 40 * 0.75))
    assert job.low_s < job.predicted_s < job.high_s and job.images == 80 and job.bottleneck == "inference"


def test_an_unsampled_class_is_scaled_up_from_the_nearest_and_said_so():
    images = _sample([[("e1/s1", 0.1, 0.2)] * 4] * 3)
    windows = sample_windows(images)
    costs = calibrate(images, windows, decode_parallel=1, shared_cores=True)
    decode_s, infer_s, note = costs.cost("e3/s3")
    assert decode_s == pytest.approx(0.1 * 16) and infer_s == pytest.approx(0.2 * 16)
    assert "not sampled" in note
    job = project({"e3/s3": 10}, 10, costs, windows, fixed_s=20.0 - windows.steady_s, spread=0.1)
    assert any("10 images: class e3/s3 not sampled" in a for a in job.assumptions)


def test_more_gpus_and_decode_cores_scale_each_stage_and_the_slower_one_sets_the_pace():
    images = _sample([[("e1/s1", 0.3, 0.1)] * 4] * 4)  # decode 0.3 s an image, inference 0.1 s
    windows = sample_windows(images)
    costs = calibrate(images, windows, decode_parallel=1, shared_cores=False)
    here = project({"e1/s1": 1000}, 1000, costs, windows, fixed_s=20.0 - windows.steady_s, spread=0.1)
    assert here.bottleneck == "decode" and here.decode_cores_per_gpu == pytest.approx(3.0)
    wider = project({"e1/s1": 1000}, 1000, costs, windows, fixed_s=20.0 - windows.steady_s, spread=0.1, gpus=2, decode_cores=6)
    # decode 0.3 / 6 = 0.05 s an image, inference 0.1 / 2 = 0.05: both halve... then inference is not slower.
    assert wider.steady_s == pytest.approx(here.steady_s * (0.05 / 0.3), rel=0.02)
    assert any("2 GPU" in line for line in wider.scaled) and any("6 decode" in line for line in wider.scaled)


def test_decoding_while_the_model_loads_is_free_even_beyond_the_sample():
    # The whole sample was decoded 10 s before the model was ready, at 1 image per second.
    images = [SampleImage("e1/s1", 1.0, 0.5, 100.0 + i // 4, decoded_at=80.0 + i, batch=f"b{i // 4}", batch_s=1.0)
              for i in range(12)]
    windows = sample_windows(images)
    assert windows.decode_exhausted and windows.decode_rate_warmup == pytest.approx(1.0)
    costs = calibrate(images, windows, decode_parallel=1, shared_cores=True)
    job = project({"e1/s1": 100}, 100, costs, windows, fixed_s=30.0 - windows.steady_s, spread=0.1)
    free = 1 + 1.0 * (windows.steady_start - 80.0)  # decode's rate times the time until the model was ready
    assert int(free) == 20
    expected_busy = (100 - int(free)) * 1.0 + 100 * 0.5
    assert job.steady_s == pytest.approx(costs.scale * expected_busy)


def test_the_range_follows_the_steady_rate_spread():
    steady = [SampleImage("e1/s1", 0, 0, 10.0 + t) for t in (1, 2, 3, 4, 5, 6)]
    assert rate_spread(steady, after=10.0) == pytest.approx(0.0, abs=1e-9)
    uneven = [SampleImage("e1/s1", 0, 0, 10.0 + t) for t in (1, 2, 3, 6, 9, 12)]
    assert rate_spread(uneven, after=10.0) > 0.5


def test_a_warm_up_shared_with_decode_all_along_is_longer():
    from vlmstream.projection.job import contended_warmup

    # 2 cores, 2 decode processes: loading gets 2/3 of a core while decode works. Decode worked 6 s of a 20 s warm-up.
    assert contended_warmup(20.0, 6.0, cores=2, decode_parallel=2) == pytest.approx((6 * 2 / 3 + 14) / (2 / 3))
    assert contended_warmup(20.0, 20.0, cores=2, decode_parallel=2) == pytest.approx(20.0)  # it already was
    assert contended_warmup(20.0, 6.0, cores=8, decode_parallel=2) == pytest.approx(20.0)  # cores to spare
    # Decode at nice 10 (as `run` starts it beside inference) weighs about a tenth: loading keeps its core.
    assert contended_warmup(20.0, 6.0, cores=2, decode_parallel=2, decode_niceness=10) == pytest.approx(20.0)
    assert contended_warmup(20.0, 6.0, cores=1, decode_parallel=2, decode_niceness=10) > 20.0


def test_on_shared_cores_the_cpu_is_the_third_limit():
    from vlmstream.projection.costs import ClassCosts

    costs = ClassCosts({"e1/s1": 0.0}, {"e1/s1": 0.0}, 1.0, True, decode_parallel=2, cores=2, infer_threads=1)
    # Light decode beside one-thread inference: inference's own time sets the pace (decode uses the other core).
    assert costs.wall(10.0, 50.0) == pytest.approx(50.0)
    # Heavy decode: 200 CPU s of decode and 60 of inference over 2 cores, more than either stage alone.
    assert costs.wall(200.0, 60.0) == pytest.approx(130.0)
    # Inference on every core: the stages' times add.
    costs.infer_threads = 2
    assert costs.wall(10.0, 50.0) == pytest.approx(55.0)


def test_inference_measured_in_cpu_time_is_wall_time_on_its_threads_and_cpu_time_on_the_shared_cores():
    from vlmstream.projection.costs import ClassCosts

    costs = ClassCosts({"e1/s1": 0.0}, {"e1/s1": 0.0}, 1.0, True, decode_parallel=2, cores=2, infer_threads=2,
                       infer_cpu=True)
    # 100 CPU s of inference over its 2 threads: 50 s on its own, but 110 CPU s in all over 2 cores.
    assert costs.wall(10.0, 100.0) == pytest.approx(55.0)
    assert costs.wall(0.0, 100.0) == pytest.approx(50.0)
    # The same figure as wall time on 2 threads is twice the CPU.
    costs.infer_cpu = False
    assert costs.wall(0.0, 100.0) == pytest.approx(100.0)


def test_an_engine_running_requests_at_once_costs_each_image_its_share_of_the_window():
    # vLLM-like: 1,000 images described over a 10 s steady window, each request 5 s in the engine (its latency, with
    # hundreds in flight); the large ones twice as long. No batches of their own.
    images = [SampleImage("e2/s5" if i % 4 == 0 else "e1/s1", 0.02, 10.0 if i % 4 == 0 else 5.0,
                          100.0 + i * 0.01, decoded_at=90.0 + i * 0.001) for i in range(1000)]
    windows = sample_windows(images, steady_start=100.0)
    shared, converted = engine_shares(images, windows)
    assert converted
    # Each image's engine seconds now add up to the window's wall time, the large ones costing twice the small.
    inside = [im for im in shared if im.done_at > windows.steady_start]
    assert sum(im.infer_s for im in inside) == pytest.approx(windows.steady_s)
    small = next(im for im in shared if im.size_class == "e1/s1").infer_s
    assert next(im for im in shared if im.size_class == "e2/s5").infer_s == pytest.approx(2 * small)
    costs = calibrate(shared, windows, decode_parallel=16, shared_cores=False)
    assert costs.scale == pytest.approx(1.0, rel=0.01)  # the window's rate, not a latency rescued by the scale
    job = project({"e1/s1": 7500, "e2/s5": 2500}, 10000, costs, windows, fixed_s=60.0, spread=0.05)
    assert job.bottleneck == "inference"
    assert job.predicted_s == pytest.approx(60.0 + 10 * windows.steady_s, rel=0.02)
    # Decode: 0.02 s an image on one core against ~0.01 s of the engine's: about two cores keep it busy.
    assert 1.5 < job.decode_cores_per_gpu < 2.5
    # Batched engines are left as they are.
    batched = _sample([[("e1/s1", 0.1, 0.2)] * 4] * 3)
    assert engine_shares(batched, sample_windows(batched)) == (batched, False)


def test_an_engine_that_shares_out_takes_its_costs_from_the_steady_window_not_the_first_wave():
    # vLLM as the sample runs it: a first wave of 200 images queued while the model loaded, described together as it
    # came up, each having waited ~4 s in the engine; then 800 in a steady window of 40 s (20 img/s), each in the
    # engine ~1 s (its latency with a queue). Every image is one class: it costs the engine 50 ms of throughput.
    wave = [SampleImage("e3/s3", 0.02, 4.0, 99.5 + i * 0.002, decoded_at=60.0) for i in range(200)]
    steady = [SampleImage("e3/s3", 0.02, 1.0, 100.0 + (i + 1) * 0.05, decoded_at=95.0 + i * 0.05) for i in range(800)]
    windows = sample_windows(wave + steady, steady_start=100.0)
    shared, converted = engine_shares(wave + steady, windows)
    assert converted and windows.warmup_images == 200
    costs = calibrate(shared, windows, decode_parallel=16, shared_cores=False)
    # The first wave's shares (four times the steady ones) stay out of the class's cost.
    assert costs.infer_s["e3/s3"] == pytest.approx(0.05, rel=0.01)
    job = project({"e3/s3": 10_000}, 2500, costs, windows, fixed_s=60.0, spread=0.05)
    # The job's images after its own first wave, at the window's 20 img/s.
    assert job.predicted_s == pytest.approx(60.0 + (10_000 - 200) / 20, rel=0.01)


def test_a_compile_cache_the_sample_filled_comes_off_the_runs_start_and_stays_in_the_ranges_top():
    images = [SampleImage("e3/s3", 0.02, 1.0, 100.0 + (i + 1) * 0.05, decoded_at=95.0) for i in range(400)]
    windows = sample_windows(images, steady_start=100.0)
    shared, _ = engine_shares(images, windows)
    costs = calibrate(shared, windows, decode_parallel=16, shared_cores=False)
    cold = project({"e3/s3": 4000}, 1000, costs, windows, fixed_s=100.0, spread=0.05)
    warm = project({"e3/s3": 4000}, 1000, costs, windows, fixed_s=100.0, spread=0.05, cached_compile_s=30.0)
    assert warm.predicted_s == pytest.approx(cold.predicted_s - 30.0)
    assert warm.fixed_s == pytest.approx(70.0)
    assert warm.high_s == pytest.approx(cold.high_s) and warm.low_s < cold.low_s


def _trickled_sample(sizes: list[int], *, per_batch_s: float, per_image_s: float, stretch: float,
                     start: float = 100.0) -> list[SampleImage]:
    """A CPU engine's sample: batches of the given sizes, each costing per_batch_s + per_image_s an image of CPU
    time (shared out over its images as the estimate shares it) and stretch times that in wall time, back to back."""
    out, at = [], start
    for b, k in enumerate(sizes):
        cpu = per_batch_s + k * per_image_s
        at += cpu * stretch
        for _ in range(k):
            out.append(SampleImage("e1/s3", 0.01, cpu / k, at, decoded_at=at - cpu * stretch - 0.01, batch=f"b{b}",
                                   batch_s=cpu * stretch, infer_cpu=True, decode_cpu=True))
    return out


def test_a_sample_of_emptier_batches_still_projects_a_job_of_full_ones_inside_its_range():
    from vlmstream.projection.costs import fit_batches

    # The engine pays 60 ms of CPU per batch whatever it holds, plus 30 ms per image; the machine stretches its
    # batches 1.5x. The sample's images trickled in: batches of 1-3. The job has a queue: batches of 8.
    a, m, stretch, size = 0.06, 0.03, 1.5, 8
    images = _trickled_sample([1, 2, 1, 3, 1, 1, 2, 1, 3, 1, 2, 1], per_batch_s=a, per_image_s=m, stretch=stretch)
    fit = fit_batches(images)
    assert fit.fitted and fit.per_batch_s == pytest.approx(a, rel=0.01) and fit.stretch == pytest.approx(stretch)
    assert fit.mean_images < 2
    windows = sample_windows(images)
    costs = calibrate(images, windows, decode_parallel=2, shared_cores=True, cores=2, infer_threads=1,
                      batch_size=size)
    assert costs.infer_s["e1/s3"] == pytest.approx(m, rel=0.01)
    n, fixed = 2000, 20.0
    job = project({"e1/s3": n}, n, costs, windows, fixed_s=fixed, spread=0.1)
    # The simulated run: full batches all along (decode at 10 ms an image keeps far ahead).
    actual = fixed + n / size * (a + size * m) * stretch
    assert job.batch_images == size
    assert job.predicted_s == pytest.approx(actual, rel=0.03)
    assert job.low_s <= actual <= job.high_s
    # Costs per image as the sample's emptier batches ran them would have missed the run, far outside that range.
    per_image_as_sampled = statistics.fmean(im.infer_s for im in images)
    assert fixed + n * per_image_as_sampled * stretch > job.high_s * 1.5


def test_batches_run_as_full_as_decode_fills_them_when_decode_is_behind():
    from vlmstream.projection.job import batch_occupancy

    images = _trickled_sample([1, 2, 1, 3, 1, 1, 2, 1, 3, 1, 2, 1], per_batch_s=0.06, per_image_s=0.03, stretch=1.0)
    windows = sample_windows(images)
    costs = calibrate(images, windows, decode_parallel=1, shared_cores=False, batch_size=8)
    costs.scale = 1.0
    # Decode delivers an image every 50 ms: a batch of k runs 60 + 30k ms, in which decode delivers (60 + 30k) / 50;
    # k = 3 solves it.
    assert batch_occupancy(costs, decode_s=0.05, infer_s=0.03) == pytest.approx(3.0, rel=0.01)
    # Decode far ahead: full batches.
    assert batch_occupancy(costs, decode_s=0.001, infer_s=0.03) == 8.0


def test_the_range_holds_the_machine_s_other_work_moving_and_says_so():
    from vlmstream.projection.job import Load

    images = _trickled_sample([2] * 12, per_batch_s=0.0, per_image_s=0.05, stretch=1.0)
    windows = sample_windows(images)
    costs = calibrate(images, windows, decode_parallel=2, shared_cores=True, cores=2, infer_threads=1)
    calm = project({"e1/s3": 1000}, 1000, costs, windows, fixed_s=10.0, spread=0.05)
    loaded = project({"e1/s3": 1000}, 1000, costs, windows, fixed_s=10.0, spread=0.05,
                     load=Load(before=3.0, after=4.0, cores=2))
    assert loaded.predicted_s == pytest.approx(calm.predicted_s)
    # Other work moved by a whole process during the sample: the range allows as much either way.
    own = 1 + min(2, 1000 * 0.01 / loaded.steady_s)
    assert loaded.range_parts["load_up"] == pytest.approx((4.0 + own) / (3.0 + own) - 1, rel=0.01)
    assert loaded.high_s > calm.high_s and loaded.low_s < calm.low_s
    assert any("load average of 3.0" in note and "longer" in note for note in loaded.assumptions)
    # On a quiet machine the job's own processes fit the cores: less other work cannot make it faster.
    quiet = project({"e1/s3": 1000}, 1000, costs, windows, fixed_s=10.0, spread=0.05,
                    load=Load(before=0.2, after=0.3, cores=2))
    assert quiet.range_parts["load_down"] == pytest.approx(0.0, abs=1e-9)


def test_a_sample_whose_costs_vary_gets_a_wider_range():
    steady = _trickled_sample([2] * 12, per_batch_s=0.0, per_image_s=0.05, stretch=1.0)
    varied = [dataclasses.replace(im, infer_s=im.infer_s * (0.3 if n % 2 else 1.7)) for n, im in enumerate(steady)]
    for images in (steady, varied):
        windows = sample_windows(images)
        costs = calibrate(images, windows, decode_parallel=2, shared_cores=True, cores=2, infer_threads=1)
        job = project({"e1/s3": 100}, 100, costs, windows, fixed_s=10.0, spread=0.05)
        if images is steady:
            assert job.range_parts["sampled_costs"] == pytest.approx(0.0, abs=1e-6)
        else:
            # Twice the standard error of the class's mean: costs 0.3x and 1.7x the mean, 24 images.
            assert job.range_parts["sampled_costs"] == pytest.approx(2 * 0.7 * (24 / 23) ** 0.5 / 24 ** 0.5, rel=0.01)
            width = (0.05 ** 2 + job.range_parts["sampled_costs"] ** 2) ** 0.5
            assert job.high_s == pytest.approx(10.0 + job.steady_s * (1 + width))


def test_decode_that_ran_out_before_the_rest_of_the_sample_was_published_is_exhausted():
    # 4 images decoded 1 s apart from t=80, the model ready (and the rest published) at 95: decode had stopped.
    images = [SampleImage("e1/s1", 0.1, 0.1, 96.0 + i, decoded_at=80.0 + i if i < 4 else 95.5 + i, batch=f"b{i}",
                          batch_s=0.5) for i in range(10)]
    windows = sample_windows(images, steady_start=95.0)
    assert windows.decode_exhausted and windows.decode_ran_out_at == 83.0
    # Two of the rest decoded just before the caller noted the time it published them: still run out, at 83.
    early = [dataclasses.replace(im, decoded_at=94.9) if i in (4, 5) else im for i, im in enumerate(images)]
    windows = sample_windows(early, steady_start=95.0)
    assert windows.decode_exhausted and windows.decode_ran_out_at == 83.0
    assert windows.decode_rate_warmup == pytest.approx(1.0)
    # Decoding right up to the moment: it was still busy.
    busy = [dataclasses.replace(im, decoded_at=91.5 + i if i < 4 else 95.5 + i) for i, im in enumerate(images)]
    assert not sample_windows(busy, steady_start=95.0).decode_exhausted


def test_the_live_eta_says_how_sure_it_is_and_is_less_sure_early():
    early = StageMeter("inference", window_s=60)
    for t, done in ((0, 0), (5, 0), (10, 10), (15, 20)):
        early.observe(t, done)
    late = StageMeter("inference", window_s=60)
    for t in range(0, 120, 5):
        late.observe(t, 2 * max(0, t - 5))
    e, l_ = early.eta(100), late.eta(100)
    assert e.seconds == pytest.approx(50, rel=0.01) and l_.seconds == pytest.approx(50, rel=0.01)
    assert e.sure > l_.sure and e.sure <= 0.6 + 1e-9
    assert "±" in e.render() and "ETA" in progress_line(late, late.done + 100) and "±" in progress_line(late, 300)


def test_the_load_s_move_leaves_out_what_the_sample_itself_added():
    from vlmstream.projection.job import Load

    # A 30-s sample keeping 2 processes busy adds 2 * (1 - e^-0.5) to the 1-min average it ends on.
    own = Load.sample_share(busy_s=60.0, span_s=30.0)
    assert own == pytest.approx(2 * (1 - 2.718281828 ** -0.5), rel=1e-6)
    assert Load(before=0.3, after=0.3 + own, cores=2, own=own).moves() == pytest.approx(0.5)  # nothing else moved
    assert Load(before=0.3, after=1.8 + own, cores=2, own=own).moves() == pytest.approx(1.5)


def test_a_machine_that_stretched_the_sample_s_batches_unevenly_widens_the_range_fixed_part_included():
    even = _trickled_sample([2] * 12, per_batch_s=0.0, per_image_s=0.05, stretch=2.0)
    uneven = [dataclasses.replace(im, batch_s=im.batch_s * (0.5 if int(im.batch[1:]) % 2 else 1.5)) for im in even]
    jobs = []
    for images in (even, uneven):
        windows = sample_windows(images)
        costs = calibrate(images, windows, decode_parallel=2, shared_cores=True, cores=2, infer_threads=1)
        jobs.append(project({"e1/s3": 100}, 100, costs, windows, fixed_s=20.0, spread=0.05))
    assert jobs[0].range_parts["machine_wander"] == pytest.approx(0.0, abs=1e-9)
    assert jobs[1].range_parts["machine_wander"] == pytest.approx(0.5)  # stretches 1 and 3 about their mean 2
    assert jobs[1].predicted_s == pytest.approx(jobs[0].predicted_s)
    # Even with no steady part to speak of, the fixed part's range follows the wander.
    assert jobs[1].high_s - jobs[1].low_s > 20.0 * (1.5 - 1 / 1.5)


def test_inference_costs_come_from_the_steady_window_not_the_warm_up_s_first_batch():
    # The first batch, done while the model was still warming up, cost three times what the same images cost later.
    first = _trickled_sample([4], per_batch_s=0.0, per_image_s=0.09, stretch=1.0, start=90.0)
    later = _trickled_sample([2, 3, 2, 4], per_batch_s=0.0, per_image_s=0.03, stretch=1.0, start=100.0)
    later = [dataclasses.replace(im, batch=f"s{im.batch}") for im in later]
    windows = sample_windows(first + later, steady_start=100.0)
    costs = calibrate(first + later, windows, decode_parallel=2, shared_cores=True, cores=2, infer_threads=1)
    assert costs.infer_s["e1/s3"] == pytest.approx(0.03)

"""The GPU benchmark's pure parts, checked here because the device runs them only a few times a session: argument
parsing, per-GPU busy figures, ratios and tables, and the readers of the engines' logs and self-profiles."""

from __future__ import annotations

import json

import pytest
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "gpu"))

import arm_pipeline  # noqa: E402 - gpu_bench's parts import each other by name, from their folder
import bench_processes  # noqa: E402
import bench_report  # noqa: E402
import gpu_bench  # noqa: E402
import rates  # noqa: E402


def test_gpu_ids_pick_physical_gpus_and_count_them():
    args = gpu_bench.parse(["--budgets", "256,default,256", "--gpu-ids", "1"])
    assert args.budgets == ["256", "default"] and args.gpu_ids == [1] and args.gpus == 1
    assert gpu_bench.parse(["--gpus", "2"]).gpu_ids == [0, 1]
    env = bench_processes.gpu_env({"PATH": "/bin"}, 1)
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["VLLM_CACHE_ROOT"].endswith("vllm-gpu1")


def test_gpu_busy_counts_only_the_runs_own_gpus():
    samples = [(10.0, 0, 100.0), (10.0, 1, 20.0), (11.0, 1, 40.0), (30.0, 1, 100.0)]
    own, every = bench_processes.GpuSampler([1]), bench_processes.GpuSampler()
    own.samples = every.samples = samples
    assert own.busy(9.0, 12.0) == 0.3  # GPU 1 only: another benchmark had GPU 0
    assert every.busy(9.0, 12.0) == round(160 / 3 / 100, 3)


def test_ratios_and_tables():
    arms = {"naive": {"img_per_s": 20.0}, "ceiling-preresized": {"img_per_s": 40.0},
            "pipeline-embeds": {"img_per_s": 50.0}, "serve": {"error": "did not start"}}
    assert bench_report.ratios(arms) == {"pipeline-embeds / naive": 2.5, "pipeline-embeds / ceiling-preresized": 1.25,
                                         "ceiling-preresized / naive": 2.0}
    results = {"config": {"max_tokens": 64, "seconds": 30, "gpu_name": "H200"},
               "budgets": {"256": {"arms": arms, "ratios": bench_report.ratios(arms)}}}
    table = bench_report.markdown(results)
    assert "| pipeline-embeds | 50.0 |" in table and "pipeline-embeds / naive | 2.5" in table
    # What each arm's throughput costs in CPU: all its processes' cores over its window, per image described.
    arms["naive"].update(cpu_cores=3.0, front_end_cores=1.0)
    arms["pipeline-embeds"].update(decode_cores=2.0, infer_cores=1.5, cpu_cores=3.5)
    table = bench_report.markdown(results)
    assert "| naive | 20.0 |  |  |  |  | 3.0 | 150.0 |" in table
    assert "| pipeline-embeds | 50.0 |  |  |  | 2.0 | 3.5 | 70.0 |" in table


def test_cpu_of_a_process_tree_counts_its_children(tmp_path):
    """The cores an arm's processes use (CpuSampler: a process and its descendants) include a busy child's."""
    import subprocess
    import time

    busy_child = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'while True: pass'])"
    proc = subprocess.Popen([sys.executable, "-c", busy_child], start_new_session=True)  # kill_tree kills its group
    try:
        sampler = bench_processes.CpuSampler([proc.pid])
        t0 = time.time()
        time.sleep(3.5)
        cores = sampler.cores(t0 + 1, time.time())
        sampler.stop()
    finally:
        bench_processes.kill_tree(proc, grace_s=1)
    assert cores is not None and 0.5 < cores < 1.5  # the grandchild's spinning core, counted through its parent


def test_the_fastest_api_server_count_is_the_serve_arm():
    results = {"config": {"max_tokens": 64, "seconds": 30, "gpu_name": "H200"}, "budgets": {
        "256": {"arms": {"serve-k8": {"img_per_s": 40.0, "api_servers": 8}, "serve-k12": {"img_per_s": 44.0,
                                                                                          "api_servers": 12},
                         "pipeline-embeds": {"img_per_s": 88.0}}, "ratios": {}},
        "1280": {"arms": {"serve-k8": {"img_per_s": 20.0, "api_servers": 8}, "serve-k12": {"error": "exited"}},
                 "ratios": {}}}}
    variants = [bench_report.serve_variant(k, 192, [8, 12], [192]) for k in (8, 12)]
    assert variants == ["serve-k8", "serve-k12"]
    bench_report.best_serve(results, variants)
    assert results["budgets"]["256"]["arms"]["serve"]["api_servers"] == 12
    assert results["budgets"]["1280"]["arms"]["serve"]["best_of"] == {"k8": 20.0}
    assert bench_report.ratios(results["budgets"]["256"]["arms"])["pipeline-embeds / serve"] == 2.0
    table = bench_report.markdown(results)
    assert "| serve-k12 | 44.0 |" in table and "fastest of k8 40.0, k12 44.0" in table


def test_the_fastest_number_in_flight_is_the_serve_arm():
    """--serve-conc 192,1024: one server, the client at each number of requests in flight; the fastest is serve."""
    assert bench_report.serve_variant(8, 1024, [8], [192, 1024]) == "serve-c1024"
    assert bench_report.serve_variant(8, 1024, [4, 8], [192, 1024]) == "serve-k8-c1024"
    assert bench_report.serve_variant(8, 192, [8], [192]) == "serve"
    arms = {"serve-c192": {"img_per_s": 42.0, "conc": 192}, "serve-c1024": {"img_per_s": 50.0, "conc": 1024},
            "pipeline-embeds": {"img_per_s": 85.0}}
    bench_report.best_serve({"budgets": {"256": {"arms": arms, "ratios": {}}}}, ["serve-c192", "serve-c1024"])
    assert arms["serve"]["conc"] == 1024 and arms["serve"]["best_of"] == {"c192": 42.0, "c1024": 50.0}
    assert bench_report.ratios(arms)["pipeline-embeds / serve"] == 1.7


def test_engine_log_readers(tmp_path):
    log = tmp_path / "pipeline-embeds.log"
    log.write_text("INFO vLLM 0.26.0 up in 50.1s (mode=embeds, embeds_only=True, scheduler limits "
                   "{'max_num_seqs': 1024, 'max_num_batched_tokens': 16384})\n")
    assert arm_pipeline.engine_scheduler_limits(log) == ["{'max_num_seqs': 1024, 'max_num_batched_tokens': 16384}"]
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"windows": [{
        "t_end": 1.0, "span_s": 60.0, "process_cores": 1.4,
        "threads": [{"name": "vllm-loop", "cores": 0.9, "top_self": [["a.py:f", 0.5]] * 5}],
        "children": [{"process": "EngineCore", "cores": 1.0, "busiest_threads": [["x", 0.98]]},
                     {"process": "idle helper", "cores": 0.0, "busiest_threads": []}]}]}))
    [window] = arm_pipeline.profile_summary(profile)
    assert window["threads"][0]["top_self"] == [["a.py:f", 0.5]] * 3
    assert [c["process"] for c in window["children"]] == ["EngineCore"]


def test_phase_rates_mean_the_same_for_the_pipeline_and_serve():
    assert rates.minute_rates([1.0, 2.0, 61.0], 0.0, 120.0) == [0.03, 0.02]
    # The middle of a 150-s phase with 30-s windows: 30-120 s. A slow fill and a drain outside it do not count.
    done = [5.0, 29.0] + [30.0 + k * 0.5 for k in range(180)] + [121.0, 149.0]
    assert rates.steady_rate(done, 0.0, 150.0, 30.0) == 2.0
    assert rates.steady_rate(done, 0.0, 80.0, 30.0) is None  # no middle as long as a window
    figures = rates.phase_rates(done, 0.0, 150.0, 30.0)
    assert figures["img_per_s"] == round(184 / 150, 2) and figures["steady_img_per_s"] == 2.0
    assert figures["first_window_img_per_s"] == round(3 / 30, 2)  # 5, 29 and the first at 30.0
    assert figures["last_window_img_per_s"] == round(2 / 30, 2) and figures["minute_rates"] == [1.03, 2.0]
    assert rates.phase_rates(done, 0.0, 60.0, 30.0)["window_s"] == 20.0  # a third of a short phase
    # serve's client reports through the same function, and the ratios then compare the steady middles too.
    arms = {"pipeline-embeds": {"img_per_s": 20.0, "steady_img_per_s": 22.0},
            "serve": {"img_per_s": 16.0, "steady_img_per_s": 17.6}}
    assert bench_report.ratios(arms) == {"pipeline-embeds / serve": 1.25, "pipeline-embeds / serve, steady": 1.25}
    assert "steady 17.6 img/s" in bench_report.markdown(
        {"config": {"max_tokens": 64, "seconds": 90.0}, "budgets": {"1280": {"arms": arms, "ratios": {}}}})
    import serve_client

    assert serve_client.phase_rates is rates.phase_rates


def test_offline_worker_command_enters_the_worker(tmp_path):
    """The offline arms' child must reach the worker: on 2026-11-30 it ran a module without an entry point, exited 0
    at once and the device session lost both offline arms. Here (no vLLM, or no model) the worker fails loudly."""
    import subprocess

    import arm_offline

    args = gpu_bench.parse(["--model", str(tmp_path / "no-model"), "--imgs", str(tmp_path), "--seconds", "1"])
    cmd = arm_offline.offline_worker_command(args, ["naive"], tmp_path / "results.jsonl")
    assert Path(cmd[1]).name == "gpu_bench.py"
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode != 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "vllm" in done.stderr.lower() or "no-model" in done.stderr, done.stderr[-2000:]


def test_link_documents_names_one_document_per_link_without_copying(tmp_path):
    import os

    from benchmarks.images import link_documents

    sources = [tmp_path / "a.JPG", tmp_path / "b.png"]
    for i, path in enumerate(sources):
        path.write_bytes(bytes([i]) * 100)
    link_documents(sources, tmp_path / "hard", "d0_", 3)
    link_documents(sources, tmp_path / "soft", "run-", 3, link=os.symlink)
    hard = sorted((tmp_path / "hard").iterdir())
    assert [p.name for p in hard] == ["d0_000000.jpg", "d0_000001.png", "d0_000002.jpg"]
    assert hard[2].stat().st_ino == sources[0].stat().st_ino  # the same file, not a copy
    soft = sorted((tmp_path / "soft").iterdir())
    assert [p.name for p in soft] == ["run-000000.jpg", "run-000001.png", "run-000002.jpg"]
    assert all(p.is_symlink() for p in soft) and soft[1].resolve() == sources[1]


def test_scaling_matches_progress_lines_by_time_after_the_first_document(tmp_path):
    import scaling

    def lines(path, rows):
        path.write_text("".join(json.dumps({"mode": "embeds", "budget": "256", "s_since_first_publish": s,
                                            "img_per_s_overall": o, "img_per_s_last_30s": l}) + "\n"
                                for s, o, l in rows))
        return path

    two = lines(tmp_path / "two.jsonl", [(26.6, 100.0, 90.0), (56.6, 120.0, 130.0), (300.0, 1.0, 1.0)])
    one = lines(tmp_path / "one.jsonl", [(24.1, 50.0, 40.0), (54.1, 60.0, 65.0)])
    rows = scaling.matched(scaling.progress_lines(two, "embeds", "256"), scaling.progress_lines(one, "embeds", "256"))
    assert [(r["s_two"], r["s_one"], r["overall_ratio"], r["last30_ratio"]) for r in rows] == [
        (26.6, 24.1, 2.0, 2.25), (56.6, 54.1, 2.0, 2.0)]  # 300 s has no one-GPU line within 10 s
    assert scaling.progress_lines(two, "pixels", "256") == []


def _tiny_tower(model_type: str):
    """A random-weight vision tower of ``model_type`` with a handful of small layers, and its config.json dict."""
    import importlib

    if model_type == "qwen2_vl":
        vision = {"depth": 2, "embed_dim": 32, "mlp_ratio": 2, "num_heads": 2, "hidden_size": 24, "patch_size": 14,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
        config_cls, tower_cls = "Qwen2VLVisionConfig", "Qwen2VisionTransformerPretrainedModel"
    elif model_type == "qwen2_5_vl":
        vision = {"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 24,
                  "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
                  "window_size": 112, "fullatt_block_indexes": [2]}
        config_cls, tower_cls = "Qwen2_5_VLVisionConfig", "Qwen2_5_VisionTransformerPretrainedModel"
    else:
        vision = {"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "out_hidden_size": 24,
                  "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
                  "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1]}
        config_cls, tower_cls = "Qwen3VLVisionConfig", "Qwen3VLVisionModel"
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    config_module = importlib.import_module(f"transformers.models.{model_type}.configuration_{model_type}")
    vision_config = getattr(config_module, config_cls)(**vision)
    vision_config._attn_implementation = "sdpa"
    return getattr(module, tower_cls)(vision_config).eval(), {"model_type": model_type, "vision_config": vision}


@pytest.mark.parametrize("model_type", ["qwen2_vl", "qwen2_5_vl", "qwen3_vl"])
def test_tower_flops_match_torchs_count_of_a_real_forward(model_type):
    """The achieved-TFLOPS figures of bench_vision_tower.py rest on this count; torch counts the matrix products of
    an actual forward (SDPA's math kernel, so attention is counted too) over two images, one with partial windows."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from tower_flops import tower_flops

    tower, config = _tiny_tower(model_type)
    grids = [(1, 12, 20), (1, 10, 6)]
    patch = config["vision_config"]["patch_size"]
    pixels = torch.randn(sum(t * h * w for t, h, w in grids), 3 * 2 * patch * patch)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
        tower(pixels, grid_thw=torch.tensor(grids))
    assert tower_flops(config, grids) == counter.get_total_flops()


def test_the_towers_tflops_inside_the_pipeline(tmp_path):
    """A pipeline phase's tower TFLOPS: the GFLOP of each of the kit's files at the budget (its grid as decode ships
    it), over the tower's ms per image in the engine; none for a model whose tower is vLLM's (the generic path)."""
    from PIL import Image

    from benchmarks.model7b import GPU_MODELS
    from tower_flops import tower_flops
    from vlmstream.models.registry import family_of

    files = []
    for k, size in enumerate([(1200, 800), (640, 480)]):
        Image.new("RGB", size).save(tmp_path / f"{k}.jpg")
        files.append(str(tmp_path / f"{k}.jpg"))
    model = GPU_MODELS["qwen2.5-vl-7b"](tmp_path / "q25")
    family, config = family_of(model), json.loads((model / "config.json").read_text())
    budget = bench_processes.BUDGETS["256"]
    grids = [(1, h // 14, w // 14) for h, w in (family.target_size(800, 1200, bench_processes.MIN_PIXELS, budget),
                                                 family.target_size(480, 640, bench_processes.MIN_PIXELS, budget))]
    gflop = arm_pipeline.tower_gflop_per_image(str(model), files, budget)
    assert gflop == round(tower_flops(config, grids) / 2 / 1e9, 1) and gflop > 100
    in_engine = arm_pipeline.tower_in_engine(gflop, {"encode_ms_per_image": 4.0}, in_vllm_engine=True)
    assert in_engine == {"tower_gflop_per_image": gflop, "tower_tflops_in_engine": round(gflop / 4.0, 1),
                         "tower_timed_by": "CUDA events in vLLM's engine"}
    # In the consumer's own process the clock is a pass's wall time on a shared GPU: the report must say so.
    assert "wall time" in arm_pipeline.tower_in_engine(gflop, {"encode_ms_per_image": 4.0},
                                                       in_vllm_engine=False)["tower_timed_by"]
    assert arm_pipeline.tower_in_engine(gflop, {}, in_vllm_engine=True) == {}
    assert arm_pipeline.tower_gflop_per_image(str(GPU_MODELS["gemma3-4b"](tmp_path / "g3")), files, budget) is None


def test_the_towers_ms_per_image_from_either_place_it_runs():
    """The watcher's mean tower time per image: embeds mode's forward time shared by its batch, or, with the tower in
    vLLM's engine process, the GPU ms per image the engine's clock gave; each timing averaged over
    the records that carry it."""
    import threading

    watcher = object.__new__(arm_pipeline.TopicWatcher)  # its Kafka reader is not what is under test
    watcher._lock, watcher._timings = threading.Lock(), {}
    watcher._add_timings("a_", json.dumps({"timings_ms": {"encode_ms": 40.0, "encode_batch_images": 4.0}}).encode())
    watcher._add_timings("a_", json.dumps({"timings_ms": {"encode_ms": 30.0, "encode_batch_images": 1.0}}).encode())
    watcher._add_timings("b_", json.dumps({"timings_ms": {"generate_ms": 900.0, "encode_ms_per_image": 82.5}}).encode())
    watcher._add_timings("b_", json.dumps({"timings_ms": {"generate_ms": 700.0}}).encode())  # before the first reading
    assert watcher.mean_timings("a_") == {"encode_ms": 35.0, "encode_ms_per_image": 20.0}
    assert watcher.mean_timings("b_") == {"generate_ms": 800.0, "encode_ms_per_image": 82.5}


def test_tower_benchmark_refuses_a_variant_it_does_not_know():
    """A misspelt or retired variant must not be timed as the default blocks under its own name."""
    import bench_vision_tower

    with pytest.raises(SystemExit, match="no blocks named 'fast-tritonmlp'"):
        bench_vision_tower.make_encoder(None, None, None, "fast-tritonmlp+vllm_fa3")


def test_each_tower_benchmark_variant_builds_the_encoder_its_name_says():
    """A variant's blocks (<blocks>+<attention>) pick the encoder: `fast` the pipeline's (every block the fast
    forward), `transformers` the reference (every block transformers' own), with the attention its name gives."""
    import torch

    import bench_vision_tower

    tower, _ = _tiny_tower("qwen2_5_vl")
    fast = bench_vision_tower.make_encoder(tower, torch.device("cpu"), torch.float32, "fast+sdpa")
    assert fast.attention == "sdpa" and fast.fast is not None and fast.fast.replaced == len(tower.blocks)
    reference = bench_vision_tower.make_encoder(tower, torch.device("cpu"), torch.float32, "transformers+sdpa")
    assert reference.attention == "sdpa" and reference.fast is None
    assert not any("forward" in vars(block) for block in tower.blocks)


def test_the_profiled_pass_counts_each_kernel_once():
    """A profile's kernel time is its device events' alone: an operator's device time repeats its kernels', so a sum
    over every event would count the matrix products twice and halve the share of peak."""
    from types import SimpleNamespace

    import numpy as np
    import bench_vision_tower
    from torch.autograd import DeviceType
    from tower_flops import tower_flops

    events = [SimpleNamespace(device_type=DeviceType.CPU, self_device_time_total=144.0),   # aten::addmm
              SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=100.0),  # its GEMM kernel
              SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=44.0),
              SimpleNamespace(device_type=DeviceType.CUDA, self_device_time_total=9.0, is_user_annotation=True)]
    assert bench_vision_tower.kernel_time_us(events) == 144.0
    assert bench_vision_tower.kernel_time_us(events[:1]) is None  # a CPU profile has no kernels
    config = {"vision_config": {"depth": 1, "hidden_size": 64, "intermediate_size": 128, "num_heads": 4,
                                "out_hidden_size": 64, "spatial_merge_size": 2, "patch_size": 14,
                                "temporal_patch_size": 2, "in_channels": 3}, "model_type": "qwen3_vl"}
    images = [np.zeros((56, 56, 3), np.uint8)] * 2
    flops = tower_flops(config, [(1, 4, 4)] * 2)
    # The kernel time at which these two images would run at half the peak: 0.5 of it by kernel time, 0.25 at twice.
    half_peak_us = flops / (0.5 * bench_vision_tower.H200_DENSE_BF16_TFLOPS * 1e12) * 1e6
    assert bench_vision_tower.by_kernel_time(half_peak_us, images, config, 14)[
        "share_of_h200_bf16_peak_by_kernel_time"] == 0.5
    slower = bench_vision_tower.by_kernel_time(2 * half_peak_us, images, config, 14)
    assert slower["share_of_h200_bf16_peak_by_kernel_time"] == 0.25
    assert slower["kernel_ms_per_image"] == round(half_peak_us / 1e3, 2)
    assert bench_vision_tower.by_kernel_time(None, images, config, 14) == {}


def test_device_gaps_are_the_idle_time_between_merged_device_activity():
    """bench_vision_tower.device_gaps: device events that overlap (a copy beside a kernel) make one busy block; the
    gaps between blocks, by size and the largest with their neighbours; CPU events and annotations do not count."""
    from types import SimpleNamespace

    import bench_vision_tower
    from torch.autograd import DeviceType

    def event(name, start, end, device=DeviceType.CUDA, **extra):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device,
                               **extra)

    events = [event("gemm", 0, 100), event("copy", 50, 120), event("norm", 123, 200),  # a 3 us gap
              event("aten::addmm", 200, 260, DeviceType.CPU), event("attention", 260, 400),  # a 60 us gap
              event("mark", 400, 1000, is_user_annotation=True), event("mlp", 550, 600)]  # a 150 us gap
    gaps = bench_vision_tower.device_gaps(events, largest=2)
    assert gaps["span_us"] == 600 and gaps["busy_us"] == 120 + 77 + 140 + 50
    assert gaps["idle_us"] == 3 + 60 + 150
    assert gaps["gaps_by_size"] == {"under 5 us": 1, "5-20 us": 0, "20-100 us": 1, "100 us and over": 1}
    assert gaps["largest"] == [{"us": 150, "after": "attention", "before": "mlp"},
                               {"us": 60, "after": "norm", "before": "attention"}]
    assert bench_vision_tower.device_gaps([event("aten::addmm", 0, 1, DeviceType.CPU)]) is None


def test_a_drained_stop_signals_the_consumer_alone_and_lets_it_stop_its_own_children(tmp_path):
    """The pipeline arm stops an inference consumer as a user should (README: signal the vlmstream process alone):
    its engine process, in its group, must not get the SIGTERM, or it aborts and the consumer cannot read its
    reports at close. Here the parent records whether its child was still alive when the parent's SIGTERM came."""
    import subprocess
    import time

    marker = tmp_path / "child-alive-at-parent-stop"
    parent = (
        "import signal, subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "def stop(*_):\n"
        f"    open({str(marker)!r}, 'w').write(str(child.poll() is None))\n"
        "    child.terminate(); child.wait(); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    started = time.monotonic()
    bench_processes.stop_drained(proc, grace_s=20)
    proc.stdout.close()
    assert proc.returncode == 0 and marker.read_text() == "True"  # drained by itself, its child alive until then
    assert time.monotonic() - started < 15


def test_the_pipeline_arms_infer_runs_fixed_length_outputs_with_prefix_caching_as_asked():
    """bench_infer.py (the pipeline arm's `vlmstream infer`): the engine `vlmstream infer` builds gets ignore_eos, and
    vLLM's prefix caching off unless --prefix-caching, as the offline and serve arms run; nothing else changes."""
    import bench_infer

    asked = []

    def make_engine(settings, model_path=None, **benchmark):
        asked.append((settings, model_path, benchmark))
        return "engine"

    assert bench_infer.fixed_length(make_engine, prefix_caching=False)("settings", "/m") == "engine"
    assert bench_infer.fixed_length(make_engine, prefix_caching=True)("settings") == "engine"
    assert asked == [("settings", "/m", {"ignore_eos": True, "engine_kwargs": {"enable_prefix_caching": False}}),
                     ("settings", None, {"ignore_eos": True, "engine_kwargs": None})]


def test_public_path_arm_moves_only_the_towers_place():
    """bench_infer.py --tower-in-this-process (the pipeline-embeds-public arm): embeds mode's tower runs in the
    consumer's process, handing vLLM image_embeds, however the engine decided; its ratio to the hooks' arm is
    reported."""
    from types import SimpleNamespace

    import bench_infer
    from consumers.infer.vllm_engine_tower import EngineTowerSide

    class Engine(EngineTowerSide):
        pass

    bench_infer.tower_in_this_process(Engine)
    engine = Engine()
    engine.settings = SimpleNamespace(publish_embeddings=True)
    engine.mode = "embeds"
    engine._set_tower_place(True)
    assert engine._tower_in_engine is False and engine._engine_embeddings is None and engine._embeds_here()
    assert bench_report.ratios({"pipeline-embeds": {"img_per_s": 90.0},
                                "pipeline-embeds-public": {"img_per_s": 75.0}}) == {
        "pipeline-embeds / pipeline-embeds-public": 1.2}

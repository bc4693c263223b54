"""GPU benchmark on the device: vlmstream's pipeline against plain vLLM, side by side, one H200 (or two).

Arms (same model, prompt, output length with ignore_eos, one image per request and the same pixel budget everywhere):
  naive               vLLM's LLM given full-resolution PIL images; vLLM resizes/normalises (mm_processor_kwargs budget)
  ceiling-preresized  vLLM given uint8 arrays already at the exact smart_resize size (resize done before the clock)
  ceiling-embeds      vLLM given image_embeds (LM only: no vision tower, no preprocessing) - the language model's ceiling
  pipeline-embeds     Kafka broker + `vlmstream produce` + `vlmstream decode` fleet + `vlmstream infer --mode embeds`
  pipeline-pixels     the same with `vlmstream infer --mode pixels`
  serve               `vllm serve --api-server-count K`, file:// full-resolution images from a multi-process client
`--arms naive,ceiling,...` picks a subset (`ceiling` = both ceiling arms). `--budgets 256,1280,default` measures the
arms at each budget in turn while every arm group starts its engine once (a start costs 60-95 s, a budget about
--seconds): the offline arms share one engine in one child process and run budget after budget; a pipeline mode keeps
its broker, topics and `vlmstream infer` processes and runs one phase per budget (a decode fleet at that budget, a
warm-up set, the measured documents); `vllm serve` starts once and its client runs once per budget. Every arm runs
under a hard time limit in its own process groups, which are killed afterwards; results are written to $OUT
(gpu_bench.json, gpu_bench.md) after every arm and phase, logs to $OUT/<arm>.log, and every measured (budget, arm)
prints one `PHASE ... RESULT {json}` line, so a truncated log still holds the figures.

No cache can make a repeated image cheap in any arm: engines run with prefix caching off (the pipeline's
`vlmstream infer` too, unless --prefix-caching) and the multimodal processor cache at 0 GB, so vLLM identifies every
image by its request (vllm/renderers/base.py `_process_mm_uuids`), and the pipeline's documents are distinct files
(hard links) with distinct ids. The few source JPEGs are reused to reach the counts.

Usage (device, after scripts/gpu/unpack_device.sh; see benchmarks/gpu/README.md):
  source scripts/gpu/env.sh
  python3 benchmarks/gpu/gpu_bench.py --budgets 256,1280,default --max-tokens 64 --seconds 30 --arms naive,ceiling
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(REPO))

from consumers.decode.resize import smart_resize  # noqa: E402 - the pipeline's own rule, after the path insert
BUDGETS = {"256": 256 * 28 * 28, "1280": 1280 * 28 * 28, "default": 28 * 28 * 16384}
MIN_PIXELS = 56 * 56
PROMPT_TEXT = "Describe this image in detail."
CHAT_PROMPT = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"
               "<|vision_start|><|image_pad|><|vision_end|>" + PROMPT_TEXT + "<|im_end|>\n<|im_start|>assistant\n")
OFFLINE_ARMS = ("naive", "ceiling-preresized", "ceiling-embeds")
ALL_ARMS = OFFLINE_ARMS + ("pipeline-embeds", "pipeline-pixels", "serve")
# Used only to size a pipeline phase's documents (count = rate x --seconds); a wrong guess changes how long the
# phase runs, not what it measures (it stops at --stop-after x --seconds and reports what it had).
EXPECTED_RATE = {"256": 100.0, "1280": 35.0, "default": 6.0}
# Warm-up documents per GPU of a pipeline phase. The first phase's also carry the freshly started engines' first
# requests (graph capture, compilation), later ones only need the new decode fleet in its group and the new shapes.
FIRST_WARM_DOCS_PER_GPU = 16
LATER_WARM_DOCS_PER_GPU = 8
# A pipeline phase's time beyond its measurement: stopping one decode fleet (SIGTERM drain), starting the next,
# publishing and waiting for the warm-up set.
PHASE_OVERHEAD_S = 90.0


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --- processes ----------------------------------------------------------------------------------------------------


def vlmstream_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "vlmstream.cli", *args]


def gpu_env(env: dict[str, str], gpu: int) -> dict[str, str]:
    """env for a process on physical GPU `gpu`. Each GPU gets its own vLLM cache: two engines starting at once on
    one host (two GPUs, or two benchmarks side by side) would otherwise compile into the same folder."""
    return dict(env, CUDA_VISIBLE_DEVICES=str(gpu),
                VLLM_CACHE_ROOT=env.get("VLLM_CACHE_ROOT") or os.path.expanduser(f"~/.cache/vllm-gpu{gpu}"))


def spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None = None, tag: str = "") -> subprocess.Popen:
    """Start cmd in a new session (its own process group) with stdout+stderr appended to log_path."""
    with open(log_path, "ab") as f:
        f.write(f"\n===== {tag} {time.strftime('%H:%M:%S')} $ {' '.join(cmd)}\n".encode())
    out = open(log_path, "ab")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                            cwd=str(REPO), start_new_session=True)
    out.close()
    return proc


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = open(stat).read()
        except OSError:
            continue
        pid = int(stat.split("/")[2])
        ppid = int(text[text.rindex(")") + 2:].split()[1])
        kids.setdefault(ppid, []).append(pid)
    return kids


def descendants(pid: int) -> list[int]:
    kids, out, todo = _children_map(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def tree_cpu_seconds(pid: int) -> float:
    """user+system CPU seconds of pid and its live descendants (from /proc; no psutil needed)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for p in [pid, *descendants(pid)]:
        try:
            text = open(f"/proc/{p}/stat").read()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def kill_tree(proc: subprocess.Popen | None, grace_s: float = 10.0, sig: int = signal.SIGTERM) -> None:
    """Signal the process group (and any descendant that left it), wait grace_s, then SIGKILL whatever is left."""
    if proc is None:
        return
    pids = [proc.pid, *descendants(proc.pid)]
    # spawn() made proc the leader of its own group: its pgid is its pid even after it exited, and children it left
    # behind (a vLLM EngineCore, API servers) are still in that group though no longer its descendants.
    groups = {proc.pid}
    for p in pids:
        try:
            groups.add(os.getpgid(p))
        except OSError:
            pass
    for g in groups:
        try:
            os.killpg(g, sig)
        except OSError:
            pass
    for p in pids:
        try:
            os.kill(p, sig)
        except OSError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except OSError:
            pass
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def log_tail(path: Path, n: int = 2500) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return ""


# --- samplers -----------------------------------------------------------------------------------------------------


class GpuSampler:
    """nvidia-smi utilization.gpu once a second in the background: (time, gpu index, percent busy)."""

    def __init__(self, gpu_ids: list[int] | None = None) -> None:
        self.gpu_ids = set(gpu_ids) if gpu_ids is not None else None  # None: every GPU that reports
        self.samples: list[tuple[float, int, float]] = []
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> "GpuSampler":
        try:
            self._proc = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits", "-l", "1"],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        except OSError:
            return self
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            try:
                idx, util = (x.strip() for x in line.split(","))
                self.samples.append((time.time(), int(idx), float(util)))
            except ValueError:
                continue

    def busy(self, t0: float, t1: float) -> float | None:
        """Mean busy fraction over [t0, t1] of this run's GPUs (another run may use the host's other GPUs)."""
        vals = [u for t, i, u in self.samples if t0 <= t <= t1 and (self.gpu_ids is None or i in self.gpu_ids)]
        return round(sum(vals) / len(vals) / 100.0, 3) if vals else None

    def stop(self) -> None:
        kill_tree(self._proc, grace_s=1)


class CpuSampler:
    """CPU seconds of a process tree, once a second: cores used over any interval."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.samples = pids, []
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), sum(tree_cpu_seconds(p) for p in self.pids)))
            self._stop.wait(1.0)

    def cores(self, t0: float, t1: float) -> float | None:
        inside = [(t, c) for t, c in self.samples if t0 - 1 <= t <= t1 + 1]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        return round((inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0]), 2)

    def stop(self) -> None:
        self._stop.set()


# --- offline arms (one engine, child process) ---------------------------------------------------------------------


class ArmTimeout(Exception):
    pass


def offline_worker(args: argparse.Namespace) -> None:
    """Child process: one vLLM engine; for each budget in turn the offline arms, one JSON line per (budget, arm)
    appended to --results-file."""
    import numpy as np
    import torch
    from PIL import Image
    from vllm import LLM, SamplingParams

    arms = [a for a in args.arms.split(",") if a]
    files = image_files(args.imgs)
    t = time.perf_counter()
    base = [Image.open(f).convert("RGB") for f in files]
    log(f"decoded {len(base)} images in {time.perf_counter() - t:.1f}s, mean "
        f"{np.mean([b.size[0] * b.size[1] for b in base]) / 1e6:.2f} MP")

    def emit(budget: str | None, arm: str, rec: dict) -> None:
        with open(args.results_file, "a") as f:  # one write per line: the parent reads the file while it grows
            f.write(json.dumps({"budget": budget, "arm": arm, **rec}) + "\n")

    t = time.perf_counter()
    llm = LLM(model=args.model, load_format="dummy", max_model_len=args.max_model_len, enable_mm_embeds=True,
              limit_mm_per_prompt={"image": 1}, gpu_memory_utilization=args.gpu_memory_utilization, seed=0,
              enable_prefix_caching=False, mm_processor_cache_gb=0)
    init_s = time.perf_counter() - t
    log(f"engine ready in {init_s:.1f}s")
    emit(None, "_engine", {"init_s": round(init_s, 1), "gpu_mem": gpu_mem()})
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    gpu = GpuSampler(args.gpu_ids[:1]).start()

    def on_alarm(*_):
        raise ArmTimeout()

    signal.signal(signal.SIGALRM, on_alarm)

    def run(prompts: list, kw: dict | None) -> tuple[float, list]:
        t0 = time.perf_counter()
        llm.enqueue(prompts, sp, use_tqdm=False, mm_processor_kwargs=kw)
        outs = llm.wait_for_completion(use_tqdm=False)
        return time.perf_counter() - t0, outs

    def timed_arm(budget: str, name: str, make, kw: dict | None) -> None:
        signal.alarm(int(args.arm_limit))
        try:
            run([make(i) for i in range(8)], kw)  # warm-up: compile paths for this input kind and budget
            n_cal = 48
            dt_cal, _ = run([make(i) for i in range(n_cal)], kw)
            # Size the measured batch to last about --seconds. A 48-request batch runs at about 0.7 of a large
            # batch's rate (H200, 2026-11-30: 21.7 vs 31.2, 46 vs 67, 64 vs 100 img/s), hence the 1.4.
            n = int(min(args.max_requests, max(n_cal, 1.4 * n_cal / dt_cal * args.seconds)))
            prompts = [make(i) for i in range(n)]
            w0 = time.time()
            dt, outs = run(prompts, kw)
            w1 = time.time()
        finally:
            signal.alarm(0)
        rec = dict(n=len(outs), wall_s=round(dt, 2), img_per_s=round(len(outs) / dt, 2),
                   calibration_img_per_s=round(n_cal / dt_cal, 2),
                   mean_prompt_tokens=round(float(np.mean([len(o.prompt_token_ids) for o in outs])), 1),
                   gen_tokens=sum(len(o.outputs[0].token_ids) for o in outs), gpu_busy=gpu.busy(w0, w1))
        log(f"PHASE budget={budget} arm={name} RESULT {json.dumps(rec)}")
        emit(budget, name, rec)

    # Budget outer, arm inner: each budget's inputs (sizes, pre-resized arrays, embeddings) are made for it, before
    # the arm's clock starts.
    phases = [(budget, arm) for budget in args.budgets for arm in arms]
    try:
        for k, (budget, arm) in enumerate(phases):
            max_pixels = BUDGETS[budget]
            mmkw = {"min_pixels": MIN_PIXELS, "max_pixels": max_pixels}
            sizes = [smart_resize(b.size[1], b.size[0], min_pixels=MIN_PIXELS, max_pixels=max_pixels) for b in base]
            try:
                if arm == "naive":
                    timed_arm(budget, arm, lambda i: {"prompt": CHAT_PROMPT,
                                                      "multi_modal_data": {"image": base[i % len(base)]}}, mmkw)
                elif arm == "ceiling-preresized":
                    pre = [np.asarray(b.resize((w, h), Image.BICUBIC)).copy() for b, (h, w) in zip(base, sizes)]
                    timed_arm(budget, arm, lambda i: {"prompt": CHAT_PROMPT,
                                                      "multi_modal_data": {"image": pre[i % len(pre)]}}, mmkw)
                elif arm == "ceiling-embeds":
                    # Values do not matter to the language model's cost: random embeddings of the exact shape
                    # (merged tokens x 3584) with the grid of each image at the budget.
                    embs = [(torch.randn((h // 14) * (w // 14) // 4, 3584, dtype=torch.bfloat16),
                             torch.tensor([[1, h // 14, w // 14]])) for h, w in sizes]
                    timed_arm(budget, arm, lambda i: {"prompt": CHAT_PROMPT, "multi_modal_data": {"image": {
                        "image_embeds": embs[i % len(embs)][0], "image_grid_thw": embs[i % len(embs)][1]}}}, None)
                else:
                    emit(budget, arm, {"error": "unknown offline arm"})
            except ArmTimeout:
                log(f"ARM TIMEOUT budget {budget} {arm} after {args.arm_limit}s: later offline arms skipped "
                    "(engine still busy)")
                emit(budget, arm, {"error": f"timed out after {args.arm_limit}s"})
                for later_budget, later_arm in phases[k + 1:]:
                    emit(later_budget, later_arm, {"error": f"not run: budget {budget} {arm} timed out before it "
                                                            "with the engine still busy"})
                break
            except Exception as exc:  # noqa: BLE001 - record and go on with the next arm
                traceback.print_exc()
                emit(budget, arm, {"error": repr(exc)[:600]})
    finally:
        gpu.stop()
        try:
            llm.llm_engine.engine_core.shutdown()
        except Exception as exc:  # noqa: BLE001
            log(f"engine shutdown: {exc!r}")
        os._exit(0)


def gpu_mem() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as exc:  # noqa: BLE001
        return repr(exc)


def image_files(folder: str) -> list[str]:
    files = sorted(f for f in glob.glob(os.path.join(folder, "*")) if f.lower().endswith((".jpg", ".jpeg")))
    if not files:
        raise SystemExit(f"no JPEGs in {folder}")
    return files


def run_offline(args: argparse.Namespace, arms: list[str], out: Path, results: dict) -> None:
    """The offline arms at every budget in one child process (one engine start). Its records are taken as they
    come, so the files in $OUT follow each (budget, arm) even if this call is cut short."""
    res_file = out / "offline_results.jsonl"
    res_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--offline-worker", "--arms", ",".join(arms),
           "--results-file", str(res_file)] + passthrough(args)
    # One engine start, then every (budget, arm) under its own --arm-limit alarm.
    limit = args.start_limit + len(args.budgets) * len(arms) * args.arm_limit + 30
    proc = spawn(cmd, out / "offline.log", env=gpu_env(os.environ.copy(), args.gpu_ids[0]), tag="offline")
    log(f"offline arms {arms} at budgets {args.budgets} (pid {proc.pid}, hard limit {limit:.0f}s)")
    deadline = time.monotonic() + limit
    read_to = 0
    try:
        while True:
            exited = proc.poll() is not None  # before reading: all it wrote is then in the file
            read_to = take_offline_records(res_file, read_to, results, out)
            if exited:
                break
            if time.monotonic() > deadline:
                log("offline worker over its hard limit: killed")
                results.setdefault("offline_engine", {})["error"] = f"killed after {limit:.0f}s"
                break
            time.sleep(1)
    finally:
        kill_tree(proc, grace_s=5)
    take_offline_records(res_file, read_to, results, out)  # whatever it wrote while being stopped
    res_file.unlink(missing_ok=True)
    for budget in args.budgets:
        for arm in arms:
            arms_at(results, budget).setdefault(arm, {"error": "no result (see offline.log)\n"
                                                               + log_tail(out / "offline.log")})


def take_offline_records(path: Path, offset: int, results: dict, out: Path) -> int:
    """Store the offline worker's complete lines after byte offset in results (saved at once); the new offset."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except FileNotFoundError:
        return offset
    complete = data[:data.rfind(b"\n") + 1]  # a line still being written waits for the next call
    for line in complete.splitlines():
        rec = json.loads(line)
        budget, arm = rec.pop("budget"), rec.pop("arm")
        if arm == "_engine":
            results["offline_engine"] = rec
            log(f"offline engine {json.dumps(rec)}")
        else:
            arms_at(results, budget)[arm] = rec
            log(f"PHASE {arm} budget={budget} RESULT {json.dumps(rec)}")
        save(results, out)
    return offset + len(complete)


def passthrough(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--imgs", args.imgs, "--budgets", ",".join(args.budgets),
            "--max-tokens", str(args.max_tokens), "--seconds", str(args.seconds), "--arm-limit", str(args.arm_limit),
            "--max-requests", str(args.max_requests), "--max-model-len", str(args.max_model_len),
            "--gpu-memory-utilization", str(args.gpu_memory_utilization),
            "--gpu-ids", ",".join(map(str, args.gpu_ids))]


# --- pipeline arms ------------------------------------------------------------------------------------------------


class TopicWatcher:
    """Reads a mode's documents, descriptions and dead-letter topics from the beginning. Documents are grouped by the
    prefix of their id, up to and including the first "_" (`warm0_`, `d0_`: one per phase and kind): when each was
    published (record timestamp) and when its description or dead letter arrived here."""

    def __init__(self, bootstrap: str, topics: dict[str, str]) -> None:
        from kafka import KafkaConsumer, TopicPartition

        self.topics = topics
        self.consumer = KafkaConsumer(bootstrap_servers=bootstrap.split(","), group_id=None,
                                      auto_offset_reset="earliest", enable_auto_commit=False,
                                      max_partition_fetch_bytes=64 * 1024 * 1024)
        assignment = []
        for topic in (topics["documents"], topics["descriptions"], topics["deadletter"]):
            deadline = time.monotonic() + 60
            parts = self.consumer.partitions_for_topic(topic)
            while not parts and time.monotonic() < deadline:
                time.sleep(0.3)
                parts = self.consumer.partitions_for_topic(topic)
            if not parts:
                raise RuntimeError(f"topic {topic} has no partitions")
            assignment += [TopicPartition(topic, p) for p in parts]
        self.consumer.assign(assignment)
        self.consumer.seek_to_beginning()
        # Written by the reader thread, read by the phases: under the lock.
        self._lock = threading.Lock()
        self._published_ms: dict[str, list[int]] = {}
        self._done_at: dict[str, dict[str, float]] = {}
        self._dead: dict[str, int] = {}
        self._arrivals: list[tuple[float, str]] = []  # every description and dead letter: (time here, prefix)
        self._timings: dict[str, dict[str, float]] = {}  # per prefix: sums of the descriptions' timings_ms
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def prefix_of(doc: str) -> str:
        head, sep, _ = doc.partition("_")
        return head + sep

    def _run(self) -> None:
        while not self._stop.is_set():
            batch = self.consumer.poll(timeout_ms=200, max_records=5000)
            now = time.time()
            with self._lock:
                for tp, records in batch.items():
                    for r in records:
                        doc = (r.key or b"").decode(errors="replace").split("/")[0]
                        prefix = self.prefix_of(doc)
                        if tp.topic == self.topics["documents"]:
                            self._published_ms.setdefault(prefix, []).append(r.timestamp)
                            continue
                        if tp.topic == self.topics["deadletter"]:
                            self._dead[prefix] = self._dead.get(prefix, 0) + 1
                        else:
                            self._add_timings(prefix, r.value)
                        self._done_at.setdefault(prefix, {}).setdefault(doc, now)
                        self._arrivals.append((now, prefix))

    def _add_timings(self, prefix: str, value: bytes | None) -> None:
        try:
            timings = json.loads(value or b"{}").get("timings_ms") or {}
        except ValueError:
            return
        sums = self._timings.setdefault(prefix, {"n": 0.0})
        sums["n"] += 1
        for key in ("queue_ms", "generate_ms", "encode_ms"):
            if key in timings:
                sums[key] = sums.get(key, 0.0) + timings[key]
        if timings.get("encode_batch_images"):  # one tower forward per batch: its time shared by the batch
            sums["encode_ms_per_image"] = (sums.get("encode_ms_per_image", 0.0)
                                           + timings["encode_ms"] / timings["encode_batch_images"])

    def mean_timings(self, prefix: str) -> dict[str, float]:
        """Mean of each timing over the described documents of prefix (engine time per image: where it goes)."""
        with self._lock:
            sums = dict(self._timings.get(prefix, {}))
        n = sums.pop("n", 0)
        return {k: round(v / n, 1) for k, v in sums.items()} if n else {}

    def finished(self, prefix: str) -> int:
        """Documents of prefix with a description or a dead letter."""
        with self._lock:
            return len(self._done_at.get(prefix, {}))

    def in_flight(self, prefix: str) -> int:
        """Documents of prefix published and not finished yet."""
        with self._lock:
            return len(self._published_ms.get(prefix, [])) - len(self._done_at.get(prefix, {}))

    def dead_letters(self, prefix: str) -> int:
        with self._lock:
            return self._dead.get(prefix, 0)

    def published_ms(self, prefix: str) -> list[int]:
        with self._lock:
            return list(self._published_ms.get(prefix, []))

    def done_times(self, prefix: str) -> list[float]:
        """When each finished document of prefix finished, in order."""
        with self._lock:
            return sorted(self._done_at.get(prefix, {}).values())

    def others_between(self, t0: float, t1: float, prefix: str) -> int:
        """Descriptions and dead letters of other prefixes that arrived in [t0, t1]: work the GPUs did inside a
        phase's clock for documents that are not the phase's (0 unless a previous phase's documents came again)."""
        with self._lock:
            return sum(1 for t, p in self._arrivals if t0 <= t <= t1 and p != prefix)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.consumer.close()


def make_docs(folder: Path, prefix: str, n: int, files: list[str]) -> None:
    """n distinct documents (hard links of the source JPEGs, so distinct files and ids but no copying)."""
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        src = files[i % len(files)]
        dst = folder / f"{prefix}{i:06d}{os.path.splitext(src)[1].lower()}"
        try:
            os.link(src, dst)
        except OSError:
            dst.write_bytes(Path(src).read_bytes())


def pipeline_env(tag: str, args: argparse.Namespace, work: Path) -> dict[str, str]:
    env = os.environ.copy()
    for name in ("documents", "images", "descriptions", "embeddings", "results", "deadletter"):
        env[f"VLMSTREAM_TOPICS__{name.upper()}"] = f"{tag}.{name}"
    env.update({"VLMSTREAM_TOPICS__PARTITIONS": str(args.partitions),
                "VLMSTREAM_INFER__GROUP_ID": f"{tag}-infer",  # decode: a group per phase (run_pipeline)
                "VLMSTREAM_PRODUCER__STATE_DIR": str(work / "ledger"), "PYTHONUNBUFFERED": "1",
                # Off like the offline engine and `vllm serve` (they reuse images, so they must run without it).
                "VLMSTREAM_INFER__ENABLE_PREFIX_CACHING": "true" if args.prefix_caching else "false"})
    # vLLM scheduler limits for the pipeline's engines: empty = vLLM's own choice (recorded as such).
    for name in ("max_num_seqs", "max_num_batched_tokens"):
        value = getattr(args, name)
        if value:
            env[f"VLMSTREAM_INFER__{name.upper()}"] = str(value)
    return env


def commit_group_at_end(bootstrap: str, topic: str, group: str) -> None:
    """Commit the new, empty consumer group at the end of topic, so a fleet joining it skips every earlier record
    (the pipeline's consumers start a group without commits at the beginning)."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.structs import OffsetAndMetadata

    consumer = KafkaConsumer(bootstrap_servers=bootstrap.split(","), group_id=group, enable_auto_commit=False)
    try:
        parts = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
        if not parts:
            raise RuntimeError(f"topic {topic} has no partitions")
        consumer.commit({tp: OffsetAndMetadata(end, "", -1) for tp, end in consumer.end_offsets(parts).items()})
    finally:
        consumer.close()


def start_broker(out: Path) -> tuple[str, bool]:
    """The local broker's bootstrap address, and whether this call started it (only then is it stopped after)."""
    from vlmstream import broker
    from vlmstream.config import load_settings

    s = load_settings()
    bootstrap = f"{s.broker.host}:{s.broker.port}"
    if broker.port_open(s.broker.host, s.broker.port) and broker.broker_answers(bootstrap):
        log(f"reusing the broker already answering on {bootstrap}")
        return bootstrap, False
    t = time.monotonic()
    r = subprocess.run(vlmstream_cmd("broker", "start"), capture_output=True, text=True, timeout=180, cwd=str(REPO))
    with open(out / "broker.log", "a") as f:
        f.write(r.stdout + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"broker start failed ({r.returncode}): {(r.stdout + r.stderr)[-1500:]}")
    log(f"broker up on {bootstrap} in {time.monotonic() - t:.1f}s")
    return bootstrap, True


def stop_broker() -> None:
    from vlmstream.broker import _read_pid, broker_paths
    from vlmstream.config import load_settings

    pid = _read_pid(broker_paths(load_settings().broker))
    subprocess.run(vlmstream_cmd("broker", "stop"), capture_output=True, text=True, timeout=60, cwd=str(REPO))
    if pid:  # belt and braces: the process the pid file named, if it is still there
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


class ProgressLog:
    """Appends the phase's figures so far to progress.jsonl every `every` seconds: a sustained run that is killed at
    the device's command limit still leaves its rate curve behind."""

    def __init__(self, path: Path, mode: str, budget: str, every: float) -> None:
        self.path, self.mode, self.budget, self.every = path, mode, budget, every
        self.next_at = time.monotonic() + every

    def due(self) -> bool:
        return time.monotonic() >= self.next_at

    def write(self, done: list[float], published_ms: list[int], gpu: "GpuSampler") -> None:
        if not published_ms:
            return
        self.next_at += self.every
        now, t0 = time.time(), min(published_ms) / 1000.0
        recent = sum(1 for t in done if t >= now - self.every)
        rec = {"mode": self.mode, "budget": self.budget, "s_since_first_publish": round(now - t0, 1),
               "described": len(done), "img_per_s_overall": round(len(done) / max(1e-6, now - t0), 2),
               f"img_per_s_last_{int(self.every)}s": round(recent / self.every, 2),
               "gpu_busy_last": gpu.busy(now - self.every, now)}
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        log(f"PROGRESS {json.dumps(rec)}")


def profile_summary(path: Path, threads: int = 6) -> list[dict]:
    """The busiest threads of each window of a `vlmstream infer` self-profile (vlmstream/profiling.py) and its
    child processes (vLLM's EngineCore): enough to tell which thread the process waits on."""
    try:
        windows = json.loads(path.read_text())["windows"]
    except (OSError, ValueError, KeyError):
        return []
    return [{"t_end": w["t_end"], "span_s": w["span_s"], "process_cores": w["process_cores"],
             "threads": [{"name": t["name"], "cores": t["cores"], "top_self": t.get("top_self", [])[:3]}
                         for t in w["threads"][:threads]],
             "children": [{"process": c["process"], "cores": c["cores"], "busiest": c["busiest_threads"][:2]}
                          for c in w["children"] if c["cores"] > 0.05]}
            for w in windows]


def engine_scheduler_limits(log_path: Path) -> list[str]:
    """The scheduler limits each `vlmstream infer` of this log reported when its vLLM engine was up."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    return re.findall(r"scheduler limits (\{[^}]*\})", text)


def minute_rates(done: list[float], t0: float, t_end: float) -> list[float]:
    """Images/s in each whole minute from the first publish: the sustained curve of a long run."""
    return [round(sum(1 for t in done if t0 + 60 * i <= t < t0 + 60 * (i + 1)) / 60.0, 2)
            for i in range(int((t_end - t0) // 60))]


def runner_stats(log_path: Path) -> dict:
    """The inference runners' own account (the JSON RunnerStats line each logs at exit): how long each engine had
    nothing submitted after its first record, and how long of that the runner itself held fetched records (the
    runner starving it). Fractions are over all runners' spans together; visual tokens/s is the sum of the
    runners' rates (the whole group's)."""
    marker = "inference runner stopped: RunnerStats "
    try:
        runners = [json.loads(line.split(marker, 1)[1]) for line in log_path.read_text(errors="replace").splitlines()
                   if marker in line]
    except (OSError, ValueError):
        return {}
    if not runners:
        return {}
    out: dict = {"runners": len(runners)}
    for name in ("records", "described", "dead_lettered", "visual_tokens", "engine_idle_s", "idle_with_work_s"):
        out[name] = round(sum(r.get(name) or 0.0 for r in runners), 2)
    spans = [(r.get("last_done_at") or 0.0) - (r.get("first_record_at") or 0.0) for r in runners]
    if all(span > 0 for span in spans):
        out["span_s"] = [round(span, 1) for span in spans]
        out["engine_idle_fraction"] = round(sum(r["idle_after_first_s"] for r in runners) / sum(spans), 3)
        out["idle_with_work_fraction"] = round(sum(r["idle_with_work_s"] for r in runners) / sum(spans), 3)
        out["visual_tokens_per_s"] = round(sum(r["visual_tokens"] / span for r, span in zip(runners, spans)), 1)
    return out


def run_pipeline(args: argparse.Namespace, mode: str, bootstrap: str, out: Path,
                 on_phase: Callable[[str, dict], None]) -> None:
    """One mode (embeds|pixels): topics, watcher and one `vlmstream infer` per GPU are started once; then one phase
    per budget: a decode fleet at that budget, a warm-up set, the measured documents. on_phase(budget, record) gets
    each phase's figures as soon as they exist. Raises when a phase cannot be measured; later phases are then not
    run (the caller records them)."""
    tag = f"gb{int(time.time()) % 10**7}p{os.getpid()}{mode[0]}"  # two benchmarks may share one broker
    work = Path(args.work) / tag
    logp = out / f"pipeline-{mode}.log"
    env = pipeline_env(tag, args, work)
    files = image_files(args.imgs)
    deadline = (time.monotonic() + args.start_limit
                + len(args.budgets) * (args.stop_after * args.seconds + PHASE_OVERHEAD_S) + 60)
    infers: list[subprocess.Popen] = []
    decode: subprocess.Popen | None = None
    watcher = None
    gpu = GpuSampler(args.gpu_ids).start()

    def alive_or_raise() -> None:
        for p in [*infers, decode]:
            if p is not None and p.poll() is not None:
                raise RuntimeError(f"a pipeline process exited ({p.returncode}):\n{log_tail(logp)}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"arm over its hard limit\n{log_tail(logp)}")

    try:
        r = subprocess.run(vlmstream_cmd("topics", "create", "--partitions", str(args.partitions)), env=env,
                           capture_output=True, text=True, timeout=120, cwd=str(REPO))
        if r.returncode != 0:
            raise RuntimeError(f"topics create failed: {(r.stdout + r.stderr)[-1500:]}")
        watcher = TopicWatcher(bootstrap, {k: env[f"VLMSTREAM_TOPICS__{k.upper()}"] for k in
                                           ("documents", "descriptions", "deadletter")})
        for g in args.gpu_ids:
            genv = gpu_env(env, g)
            if args.profile:
                genv["VLMSTREAM_PROFILE_OUT"] = str(out / f"profile-{mode}-gpu{g}.json")
            infers.append(spawn(vlmstream_cmd("infer", "--engine", args.engine, "--mode", mode, "--model", args.model,
                                              "--max-new-tokens", str(args.max_tokens), "--ignore-eos",
                                              "--prompt", PROMPT_TEXT,
                                              # pixels mode has no embeddings of its own: publishing them would
                                              # cost a second vision pass, so it runs without (embeds mode keeps them)
                                              *(["--no-embeddings"] if mode == "pixels" else [])),
                                logp, genv, tag=f"infer gpu{g}"))

        for phase, budget in enumerate(args.budgets):
            max_pixels = BUDGETS[budget]
            # A group of its own, committed at the end of the documents topic: every earlier document is described
            # by now (phase complete or drained), and decode is at-least-once, so the previous fleet's last commits
            # may not all have landed (seen on CPU: a fleet in the same group decoded 30 of them again).
            decode_group = f"{tag}-decode{phase}"
            commit_group_at_end(bootstrap, env["VLMSTREAM_TOPICS__DOCUMENTS"], decode_group)
            decode = spawn(vlmstream_cmd("decode", "--workers", str(args.workers), "--max-pixels", str(max_pixels),
                                         "--min-pixels", str(MIN_PIXELS), "--allowed-root", str(work),
                                         "--group-id", decode_group),
                           logp, env, tag=f"decode phase {phase} budget {budget}")
            warm_prefix, measured_prefix = f"warm{phase}_", f"d{phase}_"
            n_warm = (FIRST_WARM_DOCS_PER_GPU if phase == 0 else LATER_WARM_DOCS_PER_GPU) * args.gpus
            n_docs = args.pipeline_docs or int(EXPECTED_RATE[budget] * args.gpus * args.seconds)
            make_docs(work / f"warm{phase}", warm_prefix, n_warm, files)
            make_docs(work / f"docs{phase}", measured_prefix, n_docs, files)
            rec: dict = {"mode": mode, "budget": budget, "max_pixels": max_pixels, "phase": phase, "n_docs": n_docs,
                         "decode_workers": args.workers, "gpus": args.gpus, "partitions": args.partitions,
                         "prefix_caching": args.prefix_caching,
                         # From the engines' environment: the flags, or variables exported around the run.
                         "max_num_seqs": env.get("VLMSTREAM_INFER__MAX_NUM_SEQS", "vLLM default"),
                         "max_num_batched_tokens": env.get("VLMSTREAM_INFER__MAX_NUM_BATCHED_TOKENS", "vLLM default"),

                         "max_images_in_flight": env.get("VLMSTREAM_INFER__MAX_IMAGES_IN_FLIGHT", "default")}

            # Warm-up: engines started (phase 0), this budget's shapes seen, the new decode fleet in its group and
            # every stage has handled records before the clock starts.
            t = time.monotonic()
            r = subprocess.run(vlmstream_cmd("produce", "--folder", str(work / f"warm{phase}"), "--per-file",
                                             "--force", "-q"),
                               env=env, capture_output=True, text=True, timeout=120, cwd=str(REPO))
            if r.returncode != 0:
                raise RuntimeError(f"produce (warm-up, phase {phase}) failed: {(r.stdout + r.stderr)[-1500:]}")
            while watcher.finished(warm_prefix) < n_warm:
                if time.monotonic() - t > args.start_limit:
                    raise TimeoutError(f"warm-up of phase {phase} (budget {budget}): "
                                       f"{watcher.finished(warm_prefix)}/{n_warm} back after "
                                       f"{args.start_limit}s\n{log_tail(logp)}")
                alive_or_raise()
                time.sleep(0.5)
            rec.update(warmup_s=round(time.monotonic() - t, 1), warmup_dead_letters=watcher.dead_letters(warm_prefix),
                       # What the engines took (each logs it once up; the warm-up needed them up)
                       engine_scheduler_limits=engine_scheduler_limits(logp))
            log(f"pipeline-{mode} phase {phase} budget {budget}: warm after {rec['warmup_s']}s; "
                f"publishing {n_docs} documents")

            cpu = CpuSampler([decode.pid])
            t_launch = time.time()
            producer = spawn(vlmstream_cmd("produce", "--folder", str(work / f"docs{phase}"), "--per-file",
                                           "--force", "-q"), logp, env, tag=f"produce phase {phase}")
            stop_at = time.monotonic() + args.stop_after * args.seconds
            progress = ProgressLog(out / "progress.jsonl", mode, budget, args.progress_every)
            while watcher.finished(measured_prefix) < n_docs and time.monotonic() < stop_at:
                alive_or_raise()
                if progress.due():  # copying the watcher's lists only then: a long run has tens of thousands
                    progress.write(watcher.done_times(measured_prefix), watcher.published_ms(measured_prefix), gpu)
                time.sleep(0.5)
            producer_rc = producer.poll()
            kill_tree(producer, grace_s=2)
            cpu.stop()
            done = watcher.done_times(measured_prefix)
            published = watcher.published_ms(measured_prefix)
            t0 = min(published) / 1000.0 if published else t_launch
            t_end = done[-1] if done else time.time()
            wall = max(1e-6, t_end - t0)
            win = min(args.window, wall / 3)
            first = sum(1 for t in done if t <= t0 + win)
            last = sum(1 for t in done if t >= t_end - win)
            rec["minute_rates"] = minute_rates(done, t0, t_end)
            rec.update(complete=len(done) >= n_docs, described=len(done),
                       dead_letters=watcher.dead_letters(measured_prefix),
                       wall_s=round(wall, 2), img_per_s=round(len(done) / wall, 2), window_s=round(win, 1),
                       first_window_img_per_s=round(first / win, 2), last_window_img_per_s=round(last / win, 2),
                       gpu_busy=gpu.busy(t0, t_end), gpu_busy_first_window=gpu.busy(t0, t0 + win),
                       gpu_busy_last_window=gpu.busy(t_end - win, t_end), decode_cores=cpu.cores(t0, t_end),
                       producer_rc=producer_rc, publish_lag_s=round(t0 - t_launch, 2),
                       other_phase_records=watcher.others_between(t0, t_end, measured_prefix),
                       engine_timings_mean_ms=watcher.mean_timings(measured_prefix))
            log(f"PHASE pipeline-{mode} budget={budget} RESULT {json.dumps(rec)}")
            on_phase(budget, rec)

            if not rec["complete"] and phase + 1 < len(args.budgets):
                # The rest of this phase's published documents are still in the pipeline: the GPUs would describe
                # them inside the next phase's clock. Let them finish first, unmeasured, this fleet decoding them at
                # this phase's budget (then the next group may start at the end of the topic). Only published ones:
                # the producer was stopped above, maybe early.
                time.sleep(1.0)  # the watcher reads the producer's last records
                log(f"pipeline-{mode} phase {phase}: draining {watcher.in_flight(measured_prefix)} documents "
                    "before the next phase")
                while watcher.in_flight(measured_prefix) > 0:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"phase {phase} (budget {budget}) still had "
                                           f"{watcher.in_flight(measured_prefix)} documents in flight at the arm's "
                                           "hard limit; the next phase would have measured them")
                    alive_or_raise()
                    time.sleep(0.5)
            kill_tree(decode, grace_s=20)  # SIGTERM: the fleet finishes what it holds and leaves its group
            decode = None
    finally:
        for p in [decode, *reversed(infers)]:  # SIGTERM: each drains and leaves its group; then SIGKILL what is left
            kill_tree(p, grace_s=20)
        if watcher is not None:
            watcher.close()
        gpu.stop()
        stats = runner_stats(logp)
        if args.profile:
            stats["profiles"] = {g: profile_summary(out / f"profile-{mode}-gpu{g}.json") for g in args.gpu_ids}
        if stats:
            log(f"RUNNER pipeline-{mode} {json.dumps(stats)}")
            on_phase("_runner", stats)


# --- vllm serve ---------------------------------------------------------------------------------------------------


def run_serve(args: argparse.Namespace, out: Path, on_phase: Callable[[str, dict], None]) -> None:
    """One `vllm serve` start; the client runs once per budget (the budget travels in each request's
    mm_processor_kwargs). on_phase(budget, record) gets each budget's figures, or its error when the client failed
    and the server still runs. Raises when the server does not come up or exits."""
    logp = out / "serve.log"
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model, "--load-format", "dummy",
           "--api-server-count", str(args.serve_k), "--max-model-len", str(args.max_model_len),
           "--limit-mm-per-prompt", '{"image":1}', "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--mm-processor-cache-gb", "0", "--no-enable-prefix-caching", "--seed", "0",
           "--allowed-local-media-path", str(Path(args.imgs).resolve()), "--port", str(args.serve_port)]
    server = spawn(cmd, logp, env=gpu_env(os.environ.copy(), args.gpu_ids[0]), tag="serve")
    gpu = GpuSampler(args.gpu_ids[:1]).start()
    t = time.monotonic()
    try:
        url = f"http://127.0.0.1:{args.serve_port}"
        while True:
            try:
                if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                    break
            except Exception:  # noqa: BLE001 - not up yet
                pass
            if server.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({server.returncode}):\n{log_tail(logp)}")
            if time.monotonic() - t > args.start_limit:
                raise TimeoutError(f"vllm serve not healthy after {args.start_limit}s\n{log_tail(logp)}")
            time.sleep(1)
        start_s = round(time.monotonic() - t, 1)
        log(f"serve healthy after {start_s}s")
        for budget in args.budgets:
            client_cmd = [sys.executable, str(HERE / "serve_client.py"), "--url", url, "--model", args.model,
                          "--imgs", str(Path(args.imgs).resolve()), "--seconds", str(args.seconds),
                          "--procs", str(args.serve_procs), "--conc", str(args.serve_conc),
                          "--max-tokens", str(args.max_tokens), "--max-pixels", str(BUDGETS[budget]),
                          "--min-pixels", str(MIN_PIXELS), "--prompt", PROMPT_TEXT]
            # The log is shared by the server and every client run: this run's RESULT is the one after this offset.
            log_from = logp.stat().st_size
            client = spawn(client_cmd, logp, tag=f"serve_client budget {budget}")
            try:
                client.wait(timeout=args.arm_limit)
                lines = logp.read_bytes()[log_from:].decode(errors="replace").splitlines()
                res = [ln for ln in lines if ln.startswith("RESULT ")]
                if not res:
                    raise RuntimeError(f"serve client (budget {budget}) gave no RESULT:\n{log_tail(logp)}")
                rec = json.loads(res[-1][len("RESULT "):])
                rec.update(budget=budget, api_servers=args.serve_k, start_s=start_s,
                           gpu_busy=gpu.busy(rec["t0"], rec["t0"] + rec["wall_s"]) if "t0" in rec else None)
                log(f"PHASE serve budget={budget} RESULT {json.dumps(rec)}")
            except Exception as exc:  # noqa: BLE001 - this budget failed; the server may still serve the next
                traceback.print_exc()
                rec = {"error": f"{exc!r}"[:3000]}
            finally:
                kill_tree(client, grace_s=2)
            on_phase(budget, rec)
            if server.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({server.returncode}):\n{log_tail(logp)}")
    finally:
        kill_tree(server, grace_s=10)
        gpu.stop()


# --- report -------------------------------------------------------------------------------------------------------


def arms_at(results: dict, budget: str) -> dict:
    """The arms' records at one budget."""
    return results["budgets"].setdefault(budget, {"arms": {}, "ratios": {}})["arms"]


def record_failure(results: dict, arm: str, budgets: list[str], error: str) -> None:
    """arm stopped with error at the first budget that has no record of it; the later budgets were never run."""
    missing = [b for b in budgets if arm not in arms_at(results, b)]
    for k, budget in enumerate(missing):
        arms_at(results, budget)[arm] = {"error": error[:3000] if k == 0 else
                                         f"not run: the arm stopped at budget {missing[0]}"}


def ratios(arms: dict) -> dict:
    def rate(name: str) -> float | None:
        r = arms.get(name, {})
        return r.get("img_per_s") if isinstance(r, dict) and not r.get("error") else None

    out = {}
    for p in ("pipeline-embeds", "pipeline-pixels"):
        for other in ("naive", "serve", "ceiling-preresized", "ceiling-embeds"):
            a, b = rate(p), rate(other)
            if a and b:
                out[f"{p} / {other}"] = round(a / b, 2)
    a, b = rate("ceiling-preresized"), rate("naive")
    if a and b:
        out["ceiling-preresized / naive"] = round(a / b, 2)
    a, b = rate("serve"), rate("naive")
    if a and b:
        out["serve / naive"] = round(a / b, 2)
    return out


def markdown(results: dict) -> str:
    """One table (and one ratio table) per budget."""
    c = results["config"]
    lines: list[str] = []
    for budget, section in results["budgets"].items():
        if lines:
            lines.append("")
        lines += [f"## gpu_bench: budget {budget} ({BUDGETS[budget]} px), {c['max_tokens']} output tokens "
                  f"(ignore_eos), {c['seconds']} s per arm, {c.get('gpu_name') or '?'}",
                  "", "| arm | img/s | first window | last window | GPU busy | decode cores | n | note |",
                  "|---|---|---|---|---|---|---|---|"]
        for name in ALL_ARMS:
            r = section["arms"].get(name)
            if r is None:
                continue
            if r.get("error"):
                last = [ln.strip(" │|'\")") for ln in r["error"].replace("\\n", "\n").splitlines()
                        if len(ln.strip(" │|'\")")) > 3]
                named = [ln for ln in last if "rror" in ln or "imeout" in ln or "exited" in ln or "not run" in ln]
                lines.append(f"| {name} | failed | | | | | | {(named or last or ['?'])[-1][:160].replace('|', '/')} |")
                continue
            note = []
            if name.startswith("pipeline"):
                note.append(f"phase {r.get('phase')}, {r.get('decode_workers')} decode workers, {r.get('gpus')} GPU(s), "
                            f"{'complete' if r.get('complete') else 'INCOMPLETE'}, dead letters {r.get('dead_letters')}, "
                            f"warm-up {r.get('warmup_s')} s")
                if r.get("other_phase_records"):
                    note.append(f"{r['other_phase_records']} records of other phases in the window")
                if r.get("prefix_caching"):
                    note.append("prefix caching on")
                if r.get("max_num_seqs") not in (None, "vLLM default"):
                    note.append(f"max_num_seqs {r['max_num_seqs']}, max_num_batched_tokens "
                                f"{r.get('max_num_batched_tokens')}")
            if name == "serve":
                note.append(f"--api-server-count {r.get('api_servers')}, {r.get('procs')} client procs, "
                            f"conc {r.get('conc')}")
            if "mean_prompt_tokens" in r:
                note.append(f"prompt {r['mean_prompt_tokens']} tok")
            cells = [r.get("img_per_s"), r.get("first_window_img_per_s"), r.get("last_window_img_per_s"),
                     r.get("gpu_busy"), r.get("decode_cores"), r.get("n", r.get("described", r.get("ok")))]
            lines.append(f"| {name} | " + " | ".join("" if v is None else str(v) for v in cells)
                         + f" | {'; '.join(note)} |")
        if section.get("ratios"):
            lines += ["", "| ratio | value |", "|---|---|"] + [f"| {k} | {v} |" for k, v in section["ratios"].items()]
    if results.get("runner_stats"):
        lines += ["", "Inference runners' own account (all phases of the arm, warm-ups and the gaps between them "
                  "included): engine idle = nothing submitted to it after the first record (input ran dry); idle with "
                  "work waiting = idle while the runner held fetched records (the runner starving it).", "",
                  "| arm | runners | span s (each) | engine idle | idle with work waiting | visual tokens/s (all) | described |",
                  "|---|---|---|---|---|---|---|"]
        for arm, st in results["runner_stats"].items():
            lines.append(f"| {arm} | {st.get('runners')} | {st.get('span_s')} | {st.get('engine_idle_fraction')} | "
                         f"{st.get('idle_with_work_fraction')} | {st.get('visual_tokens_per_s')} | "
                         f"{st.get('described')} |")
    return "\n".join(lines) + "\n"


def save(results: dict, out: Path) -> None:
    for section in results["budgets"].values():
        section["ratios"] = ratios(section["arms"])
    (out / "gpu_bench.json").write_text(json.dumps(results, indent=1))
    (out / "gpu_bench.md").write_text(markdown(results))


def ensure_model(path: str) -> None:
    if not Path(path, "config.json").exists():
        subprocess.run([sys.executable, str(HERE / "mk_model.py"), path], check=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="naive,ceiling,pipeline-embeds,pipeline-pixels,serve")
    ap.add_argument("--budgets", default=None, help="Comma list of pixel budgets, measured in this order with one "
                    f"engine start per arm group; of {','.join(BUDGETS)} (default 256).")
    ap.add_argument("--budget", choices=sorted(BUDGETS), default=None, help="One budget: --budgets B.")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=30.0, help="Measured time per arm and budget (roughly).")
    ap.add_argument("--model", default="/root/model", help="Built with mk_model.py when it has no config.json.")
    ap.add_argument("--imgs", default="/root/imgs", help="Folder of JPEGs (reused to reach the counts).")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_bench_out"))
    ap.add_argument("--work", default="/tmp/gpu_bench", help="Scratch folder for the pipeline's documents.")
    ap.add_argument("--workers", type=int, default=12, help="Decode worker processes (pipeline arms).")
    ap.add_argument("--gpus", type=int, default=1, help="Pipeline arms: one `vlmstream infer` per GPU, one group "
                    "(GPUs 0..N-1).")
    ap.add_argument("--gpu-ids", default="", help="Physical GPUs to use instead, e.g. 1 or 0,1 (two benchmarks side "
                    "by side on one host); the offline arms and serve use the first.")
    ap.add_argument("--partitions", type=int, default=32)
    ap.add_argument("--pipeline-docs", type=int, default=0,
                    help="Documents per pipeline phase (0: rate guess at the budget x GPUs x seconds).")
    ap.add_argument("--profile", action="store_true",
                    help="Pipeline arms: each `vlmstream infer` profiles itself (per-thread CPU, sampled Python "
                    "stacks, EngineCore's CPU; ~1-2%% of a core) into $OUT/profile-<mode>-gpu<g>.json.")
    ap.add_argument("--prefix-caching", action="store_true",
                    help="Pipeline arms: vLLM prefix caching on in `vlmstream infer` (default off, as the offline "
                    "engine and `vllm serve` must run: they reuse images).")
    ap.add_argument("--stop-after", type=float, default=2.5,
                    help="A pipeline phase stops measuring after this many x --seconds and reports what it had.")
    ap.add_argument("--window", type=float, default=30.0, help="Length of the first/last rate windows (s).")
    ap.add_argument("--max-num-seqs", type=int, default=0,
                    help="Pipeline engines' vLLM max_num_seqs (0: vLLM's choice; the 2026-11-30 runs used 1024).")
    ap.add_argument("--max-num-batched-tokens", type=int, default=0,
                    help="Pipeline engines' vLLM max_num_batched_tokens (0: vLLM's choice; 2026-11-30: 16384).")
    ap.add_argument("--progress-every", type=float, default=30.0,
                    help="Pipeline phases append their figures so far to progress.jsonl this often (s).")
    ap.add_argument("--serve-k", type=int, default=8, help="vllm serve --api-server-count.")
    ap.add_argument("--serve-procs", type=int, default=6)
    ap.add_argument("--serve-conc", type=int, default=192)
    ap.add_argument("--serve-port", type=int, default=8000)
    ap.add_argument("--start-limit", type=float, default=300.0, help="Engine/server start limit (s).")
    ap.add_argument("--arm-limit", type=float, default=0.0,
                    help="Hard limit per measured arm and budget (0: 3 x seconds + 90).")
    ap.add_argument("--max-requests", type=int, default=20000)
    ap.add_argument("--max-model-len", type=int, default=20480)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--engine", default="vllm", help="Pipeline arms' `vlmstream infer --engine` (transformers: a CPU "
                    "plumbing check with the tiny model).")
    ap.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--results-file", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.budget and args.budgets:
        ap.error("give --budgets or --budget, not both")
    budgets = [b.strip() for b in (args.budgets or args.budget or "256").split(",") if b.strip()]
    unknown = [b for b in budgets if b not in BUDGETS]
    if unknown or not budgets:
        ap.error(f"unknown budgets {unknown}; choose from {list(BUDGETS)}")
    args.budgets = list(dict.fromkeys(budgets))  # each budget once, in the order given
    args.gpu_ids = [int(g) for g in args.gpu_ids.split(",") if g.strip()] if args.gpu_ids else list(range(args.gpus))
    args.gpus = len(args.gpu_ids)
    if not args.arm_limit:
        args.arm_limit = 3 * args.seconds + 90
    return args


def main() -> None:
    # SIGTERM (an outer `timeout`, a queue stopping) unwinds through the finally blocks, which stop the engines,
    # decode fleets and servers this run started; the default action would leave them running on the GPU.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args = parse()
    if args.offline_worker:
        offline_worker(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    arms: list[str] = []
    for a in args.arms.split(","):
        arms += ["ceiling-preresized", "ceiling-embeds"] if a == "ceiling" else [a] if a else []
    unknown = [a for a in arms if a not in ALL_ARMS]
    if unknown:
        raise SystemExit(f"unknown arms {unknown}; choose from {ALL_ARMS} or ceiling")
    ensure_model(args.model)
    results: dict = {"config": {"budgets": args.budgets, "max_pixels": {b: BUDGETS[b] for b in args.budgets},
                                "max_tokens": args.max_tokens, "seconds": args.seconds, "arms": arms,
                                "model": args.model, "prompt": PROMPT_TEXT, "images": len(image_files(args.imgs)),
                                "workers": args.workers, "gpus": args.gpus, "gpu_ids": args.gpu_ids,
                                "prefix_caching": args.prefix_caching,
                                "gpu_name": subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                                           capture_output=True, text=True).stdout.strip()
                                if _has("nvidia-smi") else None},
                     "budgets": {b: {"arms": {}, "ratios": {}} for b in args.budgets}}

    def recorder(arm: str) -> Callable[[str, dict], None]:
        """Stores one budget's record of arm and rewrites the files at once."""
        def on_phase(budget: str, rec: dict) -> None:
            if budget == "_runner":  # the inference runners' own account, over all of this arm's phases
                results.setdefault("runner_stats", {})[arm] = rec
            else:
                arms_at(results, budget)[arm] = rec
            save(results, out)
        return on_phase

    t_all = time.monotonic()
    offline = [a for a in arms if a in OFFLINE_ARMS]
    if offline:
        try:
            run_offline(args, offline, out, results)
        finally:
            save(results, out)
    pipeline = [a for a in arms if a.startswith("pipeline")]
    if pipeline:
        started = False
        try:
            bootstrap, started = start_broker(out)
            for arm in pipeline:
                try:
                    run_pipeline(args, arm.split("-")[1], bootstrap, out, recorder(arm))
                except Exception as exc:  # noqa: BLE001 - record it, go on with the next arm
                    traceback.print_exc()
                    record_failure(results, arm, args.budgets, f"{exc!r}")
                finally:
                    save(results, out)
        except Exception as exc:  # noqa: BLE001
            for arm in pipeline:
                record_failure(results, arm, args.budgets, f"broker: {exc!r}")
        finally:
            if started:
                stop_broker()
            save(results, out)
    if "serve" in arms:
        try:
            run_serve(args, out, recorder("serve"))
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            record_failure(results, "serve", args.budgets, f"{exc!r}")
        finally:
            save(results, out)
    results["total_s"] = round(time.monotonic() - t_all, 1)
    save(results, out)
    print(json.dumps(results, indent=1))
    print(markdown(results))


def _has(exe: str) -> bool:
    from shutil import which

    return which(exe) is not None


if __name__ == "__main__":
    main()

"""gpu_bench's pipeline arms: broker, producer, decode fleet and `vlmstream infer` on the device, phase by
phase; the topic watcher that times them."""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

from bench_processes import (
    BUDGETS, CpuSampler, EXPECTED_RATE, FIRST_WARM_DOCS_PER_GPU, GpuSampler, LATER_WARM_DOCS_PER_GPU,
    MIN_PIXELS, PHASE_OVERHEAD_S, PROMPT_TEXT, REPO, gpu_env, image_files, kill_tree, log, log_tail, spawn,
    stop_drained, vlmstream_cmd,
)
from rates import phase_rates

from benchmarks.images import link_documents  # noqa: E402 - bench_processes put the repository on sys.path

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
        self._timings: dict[str, dict[str, tuple[float, int]]] = {}  # per prefix and timing: (sum, count)
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
        found = {key: timings[key] for key in ("queue_ms", "generate_ms", "encode_ms") if key in timings}
        if "encode_ms_per_image" in timings:  # the tower in vLLM's engine process: its GPU ms per image there
            found["encode_ms_per_image"] = timings["encode_ms_per_image"]
        elif timings.get("encode_batch_images"):  # one tower forward per batch: its time shared by the batch
            found["encode_ms_per_image"] = timings["encode_ms"] / timings["encode_batch_images"]
        sums = self._timings.setdefault(prefix, {})
        for key, ms in found.items():  # (sum, count): a timing some records lack is averaged over those with it
            total, n = sums.get(key, (0.0, 0))
            sums[key] = (total + ms, n + 1)

    def mean_timings(self, prefix: str) -> dict[str, float]:
        """Mean of each timing over the described documents of prefix that carry it (engine time per image: where it
        goes)."""
        with self._lock:
            sums = dict(self._timings.get(prefix, {}))
        return {key: round(total / n, 1) for key, (total, n) in sums.items()}

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


def pipeline_env(tag: str, args: argparse.Namespace, work: Path) -> dict[str, str]:
    env = os.environ.copy()
    for name in ("documents", "images", "descriptions", "embeddings", "results", "deadletter"):
        env[f"VLMSTREAM_TOPICS__{name.upper()}"] = f"{tag}.{name}"
    env.update({"VLMSTREAM_TOPICS__PARTITIONS": str(args.partitions),
                "VLMSTREAM_INFER__GROUP_ID": f"{tag}-infer",  # decode: a group per phase (run_pipeline)
                "VLMSTREAM_PRODUCER__STATE_DIR": str(work / "ledger"), "PYTHONUNBUFFERED": "1"})
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
    from vlmstream.broker.node import broker_answers, port_open
    from vlmstream.config import load_settings

    s = load_settings()
    bootstrap = f"{s.broker.host}:{s.broker.port}"
    if port_open(s.broker.host, s.broker.port) and broker_answers(bootstrap):
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
    from vlmstream.broker.node import broker_paths, read_pid
    from vlmstream.config import load_settings

    pid = read_pid(broker_paths(load_settings().broker))
    subprocess.run(vlmstream_cmd("broker", "stop", "--reason", "gpu_bench: a pipeline arm done"), capture_output=True,
                   text=True, timeout=60, cwd=str(REPO))
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
    child processes (vLLM's EngineCore), with their resident memory: which thread the process waits on, and
    whether memory grows over a sustained run."""
    try:
        windows = json.loads(path.read_text())["windows"]
    except (OSError, ValueError, KeyError):
        return []
    return [{"t_end": w["t_end"], "span_s": w["span_s"], "process_cores": w["process_cores"],
             "rss_mb": w.get("rss_mb"),
             "threads": [{"name": t["name"], "cores": t["cores"], "top_self": t.get("top_self", [])[:3]}
                         for t in w["threads"][:threads]],
             "children": [{"process": c["process"], "cores": c["cores"], "rss_mb": c.get("rss_mb"),
                           "busiest": c["busiest_threads"][:2]}
                          for c in w["children"] if c["cores"] > 0.05]}
            for w in windows]


def engine_scheduler_limits(log_path: Path) -> list[str]:
    """The scheduler limits each `vlmstream infer` of this log reported when its vLLM engine was up."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return []
    return re.findall(r"scheduler limits (\{[^}]*\})", text)


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


def tower_gflop_per_image(model: str, files: list[str], max_pixels: int) -> float | None:
    """Our tower's GFLOP per image at this budget (tower_flops.py: matrix products), the mean over the kit's files,
    which the phase's documents cycle through; None where vLLM runs the tower (the generic path) or tower_flops does
    not know the family."""
    from PIL import Image
    from tower_flops import tower_flops

    from vlmstream.models.registry import family_of

    family = family_of(model)
    if not family.exact_size:
        return None
    try:  # a figure beside the measurement: never a reason to lose the phase
        config = json.loads((Path(model) / "config.json").read_text())
        patch = config["vision_config"]["patch_size"]
        grids = []
        for name in files:
            with Image.open(name) as image:
                height, width = family.target_size(image.size[1], image.size[0], MIN_PIXELS, max_pixels)
            grids.append((1, height // patch, width // patch))
        return round(tower_flops(config, grids) / len(grids) / 1e9, 1)
    except (KeyError, ValueError, OSError):
        return None


def tower_in_engine(gflop_per_image: float | None, engine_timings_ms: dict, in_vllm_engine: bool) -> dict:
    """The tower's achieved TFLOPS inside the pipeline: its GFLOP per image over its time per image there, and the
    clock that time came from. In vLLM's engine process (embeds mode) CUDA events time the tower's own GPU work. In
    the inference consumer's process (the fallback where vLLM's model does not take our tower) it is the wall time of
    a batch's pass, shared by its images: the two processes' CUDA contexts time-slice one GPU, so that time holds the
    engine's slices too and the figure is a floor, not the tower's speed."""
    ms = engine_timings_ms.get("encode_ms_per_image")
    if not gflop_per_image or not ms:
        return {}
    return {"tower_gflop_per_image": gflop_per_image, "tower_tflops_in_engine": round(gflop_per_image / ms, 1),
            "tower_timed_by": ("CUDA events in vLLM's engine" if in_vllm_engine
                               else "wall time of the consumer's tower passes, the GPU shared with vLLM's engine")}


def run_pipeline(args: argparse.Namespace, arm: str, bootstrap: str, out: Path,
                 on_phase: Callable[[str, dict], None]) -> None:
    """One pipeline arm: `pipeline-embeds`, `pipeline-pixels`, or `pipeline-embeds-public` (embeds mode with the
    tower in `vlmstream infer`'s own process, handing vLLM image_embeds through its public enable_mm_embeds: the path
    the product takes on a vLLM release other than vllm_adapter.CHECKED_VLLM, measured against the hooks that run the
    tower in vLLM's engine process). Topics, watcher and one `vlmstream infer` per GPU are started once; then one phase
    per budget: a decode fleet at that budget, a warm-up set, the measured documents. on_phase(budget, record) gets
    each phase's figures as soon as they exist. Raises when a phase cannot be measured; later phases are then not
    run (the caller records them)."""
    mode = arm.split("-")[1]
    name = arm[len("pipeline-"):]  # embeds, embeds-public or pixels: its files' and records' name
    tag = f"gb{int(time.time()) % 10**7}p{os.getpid()}{name.replace('-', '')}"  # two benchmarks may share one broker
    work = Path(args.work) / tag
    logp = out / f"{arm}.log"
    env = pipeline_env(tag, args, work)
    files = image_files(args.imgs)
    deadline = (time.monotonic() + 2 * args.start_limit  # the engines' start, then the first batch (below)
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
                genv["VLMSTREAM_PROFILE_OUT"] = str(out / f"profile-{name}-gpu{g}.json")
            # bench_infer.py: `vlmstream infer` with fixed-length outputs and prefix caching as asked.
            infers.append(spawn([sys.executable, str(Path(__file__).with_name("bench_infer.py")),
                                 *(["--prefix-caching"] if args.prefix_caching else []),
                                 *(["--tower-in-this-process"] if arm.endswith("-public") else []),
                                 "--engine", args.engine, "--mode", mode, "--model", args.model,
                                 "--max-new-tokens", str(args.max_tokens), "--prompt", PROMPT_TEXT,
                                 # Pixels mode has no embeddings from the tower that serves the language model:
                                 # publishing them would cost a second vision pass, so it runs without. Embeds mode
                                 # publishes them, from the tower in vLLM's engine, which keeps them for the consumer.
                                 *(["--no-embeddings"] if mode == "pixels" else [])],
                                logp, genv, tag=f"infer gpu{g}"))

        for phase, budget in enumerate(args.budgets):
            max_pixels = BUDGETS[budget]
            # A group of its own, committed at the end of the documents topic: every earlier document is described
            # by now (phase complete or drained), and decode is at-least-once, so the previous fleet's last commits
            # may not all have landed (seen on CPU: a fleet in the same group decoded 30 of them again).
            decode_group = f"{tag}-decode{phase}"
            commit_group_at_end(bootstrap, env["VLMSTREAM_TOPICS__DOCUMENTS"], decode_group)
            # --model: the checkpoint's family decides the resize rule (factor, normalisation) decode ships for.
            decode = spawn(vlmstream_cmd("decode", "--workers", str(args.workers), "--model", args.model,
                                         "--max-pixels", str(max_pixels),
                                         "--min-pixels", str(MIN_PIXELS), "--allowed-root", str(work),
                                         "--group-id", decode_group),
                           logp, env, tag=f"decode phase {phase} budget {budget}")
            warm_prefix, measured_prefix = f"warm{phase}_", f"d{phase}_"
            n_warm = (FIRST_WARM_DOCS_PER_GPU if phase == 0 else LATER_WARM_DOCS_PER_GPU) * args.gpus
            n_docs = args.pipeline_docs or int(EXPECTED_RATE[budget] * args.gpus * args.seconds)
            link_documents(files, work / f"warm{phase}", warm_prefix, n_warm)
            link_documents(files, work / f"docs{phase}", measured_prefix, n_docs)
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
            # The limit runs first for the engines' start, then again from when every vLLM engine has logged that it
            # is up, for the first batch, which builds and compiles the tower in vLLM's engine: a 27B engine's start alone took 267 s
            # on the H200 (RESULTS.md [aa]), and one limit over both stopped the arm just after it was up.
            limit_from, engines_up = t, phase > 0
            while watcher.finished(warm_prefix) < n_warm:
                if not engines_up and len(engine_scheduler_limits(logp)) >= len(infers):
                    limit_from, engines_up = time.monotonic(), True
                if time.monotonic() - limit_from > args.start_limit:
                    raise TimeoutError(f"warm-up of phase {phase} (budget {budget}): "
                                       f"{watcher.finished(warm_prefix)}/{n_warm} back "
                                       f"{args.start_limit}s after {'the engines were up' if engines_up else 'start'}"
                                       f"\n{log_tail(logp)}")
                alive_or_raise()
                time.sleep(0.5)
            rec.update(warmup_s=round(time.monotonic() - t, 1), warmup_dead_letters=watcher.dead_letters(warm_prefix),
                       # What the engines took (each logs it once up; the warm-up needed them up)
                       engine_scheduler_limits=engine_scheduler_limits(logp))
            log(f"{arm} phase {phase} budget {budget}: warm after {rec['warmup_s']}s; "
                f"publishing {n_docs} documents")

            cpu = CpuSampler([decode.pid])
            infer_cpu = CpuSampler([p.pid for p in infers])  # each inference consumer and its vLLM engine process
            t_launch = time.time()
            producer = spawn(vlmstream_cmd("produce", "--folder", str(work / f"docs{phase}"), "--per-file",
                                           "--force", "-q"), logp, env, tag=f"produce phase {phase}")
            stop_at = time.monotonic() + args.stop_after * args.seconds
            progress = ProgressLog(out / "progress.jsonl", name, budget, args.progress_every)
            while watcher.finished(measured_prefix) < n_docs and time.monotonic() < stop_at:
                alive_or_raise()
                if progress.due():  # copying the watcher's lists only then: a long run has tens of thousands
                    progress.write(watcher.done_times(measured_prefix), watcher.published_ms(measured_prefix), gpu)
                time.sleep(0.5)
            producer_rc = producer.poll()
            kill_tree(producer, grace_s=2)
            cpu.stop()
            infer_cpu.stop()
            done = watcher.done_times(measured_prefix)
            published = watcher.published_ms(measured_prefix)
            t0 = min(published) / 1000.0 if published else t_launch
            t_end = done[-1] if done else time.time()
            rec.update(phase_rates(done, t0, t_end, args.window))
            win = rec["window_s"]
            rec.update(complete=len(done) >= n_docs, described=len(done),
                       dead_letters=watcher.dead_letters(measured_prefix),
                       gpu_busy=gpu.busy(t0, t_end), gpu_busy_first_window=gpu.busy(t0, t0 + win),
                       gpu_busy_last_window=gpu.busy(t_end - win, t_end), decode_cores=cpu.cores(t0, t_end),
                       infer_cores=infer_cpu.cores(t0, t_end),
                       producer_rc=producer_rc, publish_lag_s=round(t0 - t_launch, 2),
                       other_phase_records=watcher.others_between(t0, t_end, measured_prefix),
                       engine_timings_mean_ms=watcher.mean_timings(measured_prefix))
            rec.update(tower_in_engine(tower_gflop_per_image(args.model, files, max_pixels),
                                       rec["engine_timings_mean_ms"],
                                       # Only the tower in the consumer reports its passes' wall time (encode_ms).
                                       in_vllm_engine="encode_ms" not in rec["engine_timings_mean_ms"]))
            if rec["decode_cores"] is not None and rec["infer_cores"] is not None:
                rec["cpu_cores"] = round(rec["decode_cores"] + rec["infer_cores"], 2)
            log(f"PHASE {arm} budget={budget} RESULT {json.dumps(rec)}")
            on_phase(budget, rec)

            if not rec["complete"] and phase + 1 < len(args.budgets):
                # The rest of this phase's published documents are still in the pipeline: the GPUs would describe
                # them inside the next phase's clock. Let them finish first, unmeasured, this fleet decoding them at
                # this phase's budget (then the next group may start at the end of the topic). Only published ones:
                # the producer was stopped above, maybe early.
                time.sleep(1.0)  # the watcher reads the producer's last records
                log(f"{arm} phase {phase}: draining {watcher.in_flight(measured_prefix)} documents "
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
        kill_tree(decode, grace_s=20)  # SIGTERM: the fleet finishes what it holds and leaves its group
        for p in reversed(infers):  # the consumer alone: it stops its engine after reading the engine's reports
            stop_drained(p, grace_s=40)
        if watcher is not None:
            watcher.close()
        gpu.stop()
        stats = runner_stats(logp)
        if args.profile:
            stats["profiles"] = {g: profile_summary(out / f"profile-{name}-gpu{g}.json") for g in args.gpu_ids}
        if stats:
            log(f"RUNNER {arm} {json.dumps(stats)}")
            on_phase("_runner", stats)

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

Parts, beside this file: bench_processes.py (constants, child processes, GPU/CPU samplers), arm_offline.py,
arm_pipeline.py, arm_serve.py (one arm group each), bench_report.py (ratios, tables, files); this file parses the
arguments and runs the arm groups in turn.

Usage (device, after scripts/gpu/unpack_device.sh; see benchmarks/gpu/README.md):
  source scripts/gpu/env.sh
  python3 benchmarks/gpu/gpu_bench.py --budgets 256,1280,default --max-tokens 64 --seconds 30 --arms naive,ceiling
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from contextlib import ExitStack
from pathlib import Path
from typing import Callable

from bench_processes import ALL_ARMS, BUDGETS, HERE, OFFLINE_ARMS, PROMPT_TEXT, image_files
from bench_report import arms_at, best_serve, markdown, record_failure, save, serve_variant
from arm_offline import offline_worker, run_offline
from arm_pipeline import run_pipeline, start_broker, stop_broker
from arm_serve import run_serve
from mps import mps_daemon


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
    ap.add_argument("--mps", action="store_true", help="Run the pipeline arms under a CUDA MPS daemon of their own "
                    "(mps.py: the tower and vLLM's engine then share the GPU instead of time-slicing).")
    ap.add_argument("--serve-k", default="8", help="vllm serve --api-server-count; a comma list (8,12) starts one "
                    "server per count in turn, records each as serve-k<K> and the fastest at each budget as serve.")
    ap.add_argument("--serve-args", default="", help="More `vllm serve` arguments, as one string (vLLM 0.34's "
                    "preprocessing: '--renderer-num-workers 2 --mm-tensor-ipc torch_shm'). Where the server does not "
                    "come up with them it starts again without, and each record says serve_args_dropped.")
    ap.add_argument("--serve-procs", type=int, default=6)
    ap.add_argument("--serve-conc", default="1024", help="Requests the serve arm's client keeps in flight (1,024 by "
                    "default: serve's fastest depth on vLLM 0.34, benchmarks/RESULTS.md); a comma list (192,1024) runs "
                    "the client once per value on each server, records each as serve-c<N> and the fastest at each "
                    "budget as serve.")
    ap.add_argument("--serve-port", type=int, default=8000)
    ap.add_argument("--start-limit", type=float, default=300.0, help="Engine/server start limit (s); a pipeline arm's first batch gets as long again once its "
                    "engines are up.")
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
    args.serve_ks = [int(k) for k in str(args.serve_k).split(",") if k.strip()]
    args.serve_concs = [int(c) for c in str(args.serve_conc).split(",") if c.strip()]
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
                                "prefix_caching": args.prefix_caching, "mps": args.mps,
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
        stack = ExitStack()
        try:
            if args.mps:
                results["config"]["mps_env"] = stack.enter_context(mps_daemon())
            bootstrap, started = start_broker(out)
            for arm in pipeline:
                try:
                    run_pipeline(args, arm, bootstrap, out, recorder(arm))
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
            stack.close()
            save(results, out)
    if "serve" in arms:
        variants = [serve_variant(k, c, args.serve_ks, args.serve_concs)
                    for k in args.serve_ks for c in args.serve_concs]
        for k in args.serve_ks:
            def record(budget: str, rec: dict, k=k) -> None:
                recorder(serve_variant(k, rec["conc"], args.serve_ks, args.serve_concs))(budget, rec)
            try:
                run_serve(args, k, out, record)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                for c in args.serve_concs:
                    record_failure(results, serve_variant(k, c, args.serve_ks, args.serve_concs), args.budgets,
                                   f"{exc!r}")
            finally:
                if len(variants) > 1:
                    best_serve(results, variants)
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

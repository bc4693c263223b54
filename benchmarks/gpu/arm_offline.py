"""gpu_bench's offline arms: naive, ceiling-preresized and ceiling-embeds in one vLLM engine (a child process)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from bench_processes import (
    BUDGETS, CHAT_PROMPT, GpuSampler, MIN_PIXELS, PROMPT_TEXT, gpu_env, gpu_mem, image_files, kill_tree, log,
    log_tail, process_cpu_seconds, spawn, tree_cpu_seconds,
)
from bench_report import arms_at, save

from vlmstream.models.registry import family_of  # the pipeline's own rules (the path is set by bench_processes)
from vlmstream.vllm_process import kernel_args

GPU_BENCH = Path(__file__).resolve().with_name("gpu_bench.py")

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
    family = family_of(args.model)
    vision_config = json.loads(Path(args.model, "config.json").read_text())["vision_config"]
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
              enable_prefix_caching=False, mm_processor_cache_gb=0, **kernel_args(args.model))
    init_s = time.perf_counter() - t
    log(f"engine ready in {init_s:.1f}s")
    emit(None, "_engine", {"init_s": round(init_s, 1), "gpu_mem": gpu_mem()})
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    chat_prompt = offline_prompt(family, llm.get_tokenizer())
    log(f"{family.name} prompt: {chat_prompt!r}")
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
            # batch's rate (measured on the H200: 21.7 vs 31.2, 46 vs 67, 64 vs 100 img/s), hence the 1.4.
            n = int(min(args.max_requests, max(n_cal, 1.4 * n_cal / dt_cal * args.seconds)))
            prompts = [make(i) for i in range(n)]
            # CPU of this process (vLLM's front end: its processor, tokenizer, output handling) and of its tree (the
            # engine process too), over the measured batch.
            own0, tree0 = process_cpu_seconds(os.getpid()), tree_cpu_seconds(os.getpid())
            w0 = time.time()
            dt, outs = run(prompts, kw)
            w1 = time.time()
            own1, tree1 = process_cpu_seconds(os.getpid()), tree_cpu_seconds(os.getpid())
        finally:
            signal.alarm(0)
        rec = dict(n=len(outs), wall_s=round(dt, 2), img_per_s=round(len(outs) / dt, 2),
                   calibration_img_per_s=round(n_cal / dt_cal, 2),
                   mean_prompt_tokens=round(float(np.mean([len(o.prompt_token_ids) for o in outs])), 1),
                   gen_tokens=sum(len(o.outputs[0].token_ids) for o in outs), gpu_busy=gpu.busy(w0, w1),
                   front_end_cores=round((own1 - own0) / dt, 2), cpu_cores=round((tree1 - tree0) / dt, 2))
        log(f"PHASE budget={budget} arm={name} RESULT {json.dumps(rec)}")
        emit(budget, name, rec)

    # Budget outer, arm inner: each budget's inputs (sizes, pre-resized arrays, embeddings) are made for it, before
    # the arm's clock starts.
    phases = [(budget, arm) for budget in args.budgets for arm in arms]
    try:
        for k, (budget, arm) in enumerate(phases):
            max_pixels = BUDGETS[budget]
            # A family module's processor takes the budget; a generic model's processor keeps its own size.
            mmkw = {"min_pixels": MIN_PIXELS, "max_pixels": max_pixels} if family.exact_size else None
            # The sizes the decode stage ships at this budget (a generic model's: capped at its processor's).
            sizes = [family.target_size(b.size[1], b.size[0], MIN_PIXELS, max_pixels) for b in base]
            try:
                if arm == "naive":
                    timed_arm(budget, arm, lambda i: {"prompt": chat_prompt,
                                                      "multi_modal_data": {"image": base[i % len(base)]}}, mmkw)
                elif arm == "ceiling-preresized":
                    pre = [np.asarray(b.resize((w, h), Image.BICUBIC)).copy() for b, (h, w) in zip(base, sizes)]
                    timed_arm(budget, arm, lambda i: {"prompt": chat_prompt,
                                                      "multi_modal_data": {"image": pre[i % len(pre)]}}, mmkw)
                elif arm == "ceiling-embeds" and not family.exact_size:
                    emit(budget, arm, {"error": "not measured: a generic model's tower is vLLM's (no image_embeds)"})
                elif arm == "ceiling-embeds":
                    # Values do not matter to the language model's cost: random embeddings of the exact shape
                    # (merged tokens x the family's image_embeds width, DeepStack levels included) with each
                    # image's grid at the budget.
                    width = family.image_embeds_width(vision_config)
                    embs = [(torch.randn(family.visual_tokens(family.grid_thw(h, w)), width, dtype=torch.bfloat16),
                             torch.tensor([family.grid_thw(h, w)])) for h, w in sizes]
                    timed_arm(budget, arm, lambda i: {"prompt": chat_prompt, "multi_modal_data": {"image": {
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


def offline_prompt(family, tokenizer) -> str:
    """The offline arms' prompt: Qwen2.5-VL's fixed chat prompt (as every earlier run of these arms had it), else
    the one the pipeline's engine renders for the model (its chat template)."""
    if family.name == "qwen2_vl":
        return CHAT_PROMPT
    from consumers.infer.prompts import PromptBuilder

    return PromptBuilder(tokenizer, family).prompt(PROMPT_TEXT)


def offline_worker_command(args: argparse.Namespace, arms: list[str], res_file: Path) -> list[str]:
    """The child's command line. It runs gpu_bench.py, which owns the flags: this module has no entry point of its
    own (run as a script it would exit 0 having done nothing)."""
    return [sys.executable, str(GPU_BENCH), "--offline-worker", "--arms", ",".join(arms),
            "--results-file", str(res_file)] + passthrough(args)


def run_offline(args: argparse.Namespace, arms: list[str], out: Path, results: dict) -> None:
    """The offline arms at every budget in one child process (one engine start). Its records are taken as they
    come, so the files in $OUT follow each (budget, arm) even if this call is cut short."""
    res_file = out / "offline_results.jsonl"
    res_file.unlink(missing_ok=True)
    cmd = offline_worker_command(args, arms, res_file)
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
            arms_at(results, budget).setdefault(arm, {"error": f"no result (worker exit {proc.returncode}; see "
                                                               f"offline.log)\n" + log_tail(out / "offline.log")})


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

"""gpu_bench's serve arm: `vllm serve --api-server-count K` fed by a multi-process file:// client."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
import traceback
import urllib.request
from pathlib import Path
from typing import Callable

from bench_processes import (
    BUDGETS, CpuSampler, GpuSampler, HERE, MIN_PIXELS, PROMPT_TEXT, gpu_env, kill_tree, log, log_tail, spawn,
)

from vlmstream.models.registry import family_of  # (the path is set by bench_processes)
from vlmstream.vllm_process import kernel_args

# --- vllm serve ---------------------------------------------------------------------------------------------------


def _start_server(args: argparse.Namespace, cmd: list[str], logp: Path, url: str):
    """Start `cmd` and wait until it answers /health: (process, seconds it took). Raises when it exits first or
    takes longer than args.start_limit (the process is then stopped)."""
    env = gpu_env(os.environ.copy(), args.gpu_ids[0])
    # vLLM 0.34 refuses torch_shm tensor IPC unless its workers are spawned.
    if any("torch_shm" in part for part in cmd):
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    server = spawn(cmd, logp, env=env, tag="serve")
    t = time.monotonic()
    try:
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
    except BaseException:
        kill_tree(server, grace_s=10)
        raise
    start_s = round(time.monotonic() - t, 1)
    log(f"serve healthy after {start_s}s ({' '.join(cmd[cmd.index('serve'):])})")
    return server, start_s


def run_serve(args: argparse.Namespace, api_servers: int, out: Path, on_phase: Callable[[str, dict], None]) -> None:
    """One `vllm serve --api-server-count api_servers` start; the client runs once per budget and, at each budget,
    once per number of requests in flight (args.serve_concs) (the budget travels in each request's
    mm_processor_kwargs; a generic model's processor keeps its own size, so it gets none). on_phase(budget, record)
    gets each run's figures (record["conc"] says which), or its error when the client failed and the server still
    runs. Raises when the server does not come up or exits."""
    logp = out / f"serve-k{api_servers}.log"
    budget_kwargs = family_of(args.model).exact_size
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model, "--load-format", "dummy",
           "--api-server-count", str(api_servers), "--max-model-len", str(args.max_model_len),
           "--limit-mm-per-prompt", '{"image":1}', "--gpu-memory-utilization", str(args.gpu_memory_utilization),
           "--mm-processor-cache-gb", "0", "--no-enable-prefix-caching", "--seed", "0",
           "--allowed-local-media-path", str(Path(args.imgs).resolve()), "--port", str(args.serve_port)]
    for name, value in kernel_args(args.model).items():  # the kernels the pipeline's engine is given
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    if budget_kwargs:  # vLLM 0.34 refuses a request's mm_processor_kwargs (the budget) without this switch
        cmd.append("--trust-request-mm-kwargs")
    extra = shlex.split(args.serve_args)
    url = f"http://127.0.0.1:{args.serve_port}"
    try:
        server, start_s = _start_server(args, cmd + extra, logp, url)
        dropped = False
    except (RuntimeError, TimeoutError):
        if not extra:
            raise
        traceback.print_exc()
        log(f"vllm serve did not come up with {extra}; starting it again without them")
        server, start_s = _start_server(args, cmd, logp, url)
        dropped = True
    gpu = GpuSampler(args.gpu_ids[:1]).start()
    try:
        for budget, conc in ((b, c) for b in args.budgets for c in args.serve_concs):
            client_cmd = [sys.executable, str(HERE / "serve_client.py"), "--url", url, "--model", args.model,
                          "--imgs", str(Path(args.imgs).resolve()), "--seconds", str(args.seconds),
                          "--procs", str(args.serve_procs), "--conc", str(conc),
                          "--max-tokens", str(args.max_tokens),
                          "--max-pixels", str(BUDGETS[budget] if budget_kwargs else 0),
                          "--min-pixels", str(MIN_PIXELS), "--prompt", PROMPT_TEXT, "--window", str(args.window)]
            # The log is shared by the server and every client run: this run's RESULT is the one after this offset.
            log_from = logp.stat().st_size
            cpu = CpuSampler([server.pid])  # the server's processes (API servers, engine), not the clients
            client = spawn(client_cmd, logp, tag=f"serve_client budget {budget}, {conc} in flight")
            try:
                client.wait(timeout=args.arm_limit)
                lines = logp.read_bytes()[log_from:].decode(errors="replace").splitlines()
                res = [ln for ln in lines if ln.startswith("RESULT ")]
                if not res:
                    raise RuntimeError(f"serve client (budget {budget}, {conc} in flight) gave no RESULT:\n"
                                       f"{log_tail(logp)}")
                rec = json.loads(res[-1][len("RESULT "):])
                rec.update(budget=budget, conc=conc, api_servers=api_servers, start_s=start_s,
                           serve_args=args.serve_args, serve_args_dropped=dropped,
                           gpu_busy=gpu.busy(rec["t0"], rec["t0"] + rec["wall_s"]) if "t0" in rec else None,
                           cpu_cores=cpu.cores(rec["t0"], rec["t0"] + rec["wall_s"]) if "t0" in rec else None)
                log(f"PHASE serve budget={budget} RESULT {json.dumps(rec)}")
            except Exception as exc:  # noqa: BLE001 - this budget failed; the server may still serve the next
                traceback.print_exc()
                rec = {"error": f"{exc!r}"[:3000], "conc": conc}
            finally:
                cpu.stop()
                kill_tree(client, grace_s=2)
            on_phase(budget, rec)
            if server.poll() is not None:
                raise RuntimeError(f"vllm serve exited ({server.returncode}):\n{log_tail(logp)}")
    finally:
        kill_tree(server, grace_s=10)
        gpu.stop()

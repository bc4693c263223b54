"""How a vLLM engine process is started, for every stage that runs one (inference, condense)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import logging
import multiprocessing
import os
import threading
from pathlib import Path
from types import SimpleNamespace

from vlmstream.vllm_adapter import INSTALL_HINT, MODELS_PACKAGE, registered_models

log = logging.getLogger(__name__)


def vllm_usable() -> bool:
    """vLLM is importable and a CUDA device is visible (vLLM's CPU backend is not what we deploy): what an engine
    setting of ``auto`` picks vLLM on, for inference and condense alike."""
    if importlib.util.find_spec("vllm") is None:
        return False
    import torch

    return torch.cuda.is_available()


def load_format(model_path: str | Path) -> str:
    """vLLM's ``load_format`` for a model: a local folder with a config but no weights (benchmarks/gpu/mk_model.py)
    gets vLLM's random ones (``dummy``); anything else loads its checkpoint."""
    folder = Path(model_path)
    weightless = folder.is_dir() and not any(folder.glob("*.safetensors")) and not any(folder.glob("*.bin"))
    return "dummy" if weightless else "auto"


# Torch CPU threads of vLLM's engine process (inference and condense). vLLM lowers OMP_NUM_THREADS to 1 only when it
# runs several GPU workers; its one-GPU engine keeps a thread per core, and at 0.2 MP those threads spun on 15 of an
# H200 host's 32 cores, which the decode fleet needs, and two such engines on one host fell well short of twice one
# GPU. The engine's CPU work is one thread's anyway.
ENGINE_CPU_THREADS = 1


@contextlib.contextmanager
def engine_process_threads():
    """Start vLLM's engine process (inside this block) with ENGINE_CPU_THREADS torch/OpenMP threads; this process
    keeps its own. libgomp reads the variable when it loads, so the engine must be spawned, not forked (vLLM forks
    unless CUDA is already up here). Variables the user exported are kept as they are."""
    wanted = {"OMP_NUM_THREADS": str(ENGINE_CPU_THREADS), "VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    added = [name for name in wanted if name not in os.environ]
    os.environ.update({name: wanted[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


@contextlib.contextmanager
def child_environment(values: dict[str, str]):
    """Processes started inside this block (vLLM's engine process, an MPS client) get ``values`` in their
    environment; this process's own environment is as it was afterwards. Code of ours that vLLM runs in its engine
    process reads its settings there."""
    before = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def has_linear_attention(config: dict) -> bool:
    """Whether a checkpoint's parsed ``config.json`` has Gated DeltaNet (linear attention) layers in its language
    model: Qwen3.5 and Qwen3-Next declare them in ``layer_types`` and size them with ``linear_key_head_dim``."""
    text = config.get("text_config") or config
    return "linear_attention" in (text.get("layer_types") or []) or "linear_key_head_dim" in text


def flashinfer_gdn_installed() -> bool:
    try:
        return importlib.util.find_spec("flashinfer.gdn_prefill") is not None
    except (ImportError, ValueError):  # no flashinfer package at all, or a broken one
        return False


def kernel_args(model_path: str | Path) -> dict:
    """AsyncEngineArgs (or ``LLM`` keywords) that keep vLLM on kernels this install has, for the checkpoint folder
    ``model_path``. vLLM 0.26 picks FlashInfer's Gated DeltaNet prefill kernel on Hopper by default without checking
    that FlashInfer is installed; without it the engine starts, then dies at the first prefill of a Qwen3.5 model
    (seen on an H200 with the Qwen3.5-27B config). Then its own Triton (FLA) kernel is asked for. ``vllm serve`` takes
    the same choice as ``--gdn-prefill-backend``."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return {}
    if not has_linear_attention(json.loads(config_file.read_text())) or flashinfer_gdn_installed():
        return {}
    log.info("FlashInfer's Gated DeltaNet prefill kernel is not installed: asking vLLM for its Triton kernel "
             "(gdn_prefill_backend=triton) for %s", model_path)
    return {"gdn_prefill_backend": "triton"}


def model_module_failure(model_path: str | Path, models: dict | None = None,
                         package: str = MODELS_PACKAGE) -> str | None:
    """Why vLLM's module for the checkpoint's architecture does not import in this install, or None (it imports,
    vLLM does not know the architecture, or the folder has no config.json). vLLM inspects a model class in a
    subprocess and reports only that the inspection failed; the import error behind it (a vLLM built against
    another transformers, say) is in the engine's log alone. ``models``: architecture -> (module, class), vLLM's
    registry by default (``vllm_adapter.registered_models``)."""
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return None
    models = registered_models() if models is None else models
    if models is None:
        return None
    for architecture in json.loads(config_file.read_text()).get("architectures") or []:
        if architecture not in models:
            continue
        module = f"{package}.{models[architecture][0]}"
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - any failure to import is the answer
            return (f"vLLM's module for {architecture} ({module}) does not import here: {type(exc).__name__}: "
                    f"{str(exc)[:300]} (the installed transformers or another package is not the version this "
                    "vLLM was built against)")
    return None


class EngineUnavailable(RuntimeError):
    """vLLM cannot run here (not installed, or no CUDA device). Not retriable."""


class EngineCannotRun(RuntimeError):
    """vLLM started an engine for the model, and the engine failed its first request. Not retriable: every request
    would fail the same way."""


START_CHECK_PROMPT = "Hello"


def import_vllm(engine_setting: str) -> SimpleNamespace:
    """The vLLM names a stage's engine uses, imported on first use (the CPU install has no vLLM);
    ``engine_setting`` is the setting that picks another engine (``infer.engine``), named in the error."""
    try:
        import vllm
        from vllm.config import StructuredOutputsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.engine.exceptions import EngineDeadError
    except ImportError as exc:
        raise EngineUnavailable(
            f"this vLLM engine needs the vllm package, which cannot be imported here ({exc}). Install the GPU extra "
            f"on a CUDA machine: {INSTALL_HINT} — or set {engine_setting}=transformers.") from exc
    return SimpleNamespace(version=vllm.__version__, AsyncEngineArgs=AsyncEngineArgs, AsyncLLM=AsyncLLM,
                           SamplingParams=SamplingParams, StructuredOutputsParams=StructuredOutputsParams,
                           StructuredOutputsConfig=StructuredOutputsConfig, RequestOutputKind=RequestOutputKind,
                           DeadError=EngineDeadError, UsageContext=UsageContext)


class EngineLoop:
    """The asyncio loop thread that drives one vLLM ``AsyncLLM``, and the engine processes started while it lived."""

    def __init__(self, name: str):
        self._children_before = {p.pid for p in multiprocessing.active_children()}
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def call(self, coroutine, timeout: float):
        """Run ``coroutine`` on the loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout=timeout)

    def submit(self, coroutine) -> "asyncio.Future":
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def start_llm(self, v: SimpleNamespace, engine_args, timeout: float = 900):
        """vLLM's AsyncLLM for batch work: with the offline ``LLM`` class's defaults (on an H200 1,024 sequences and
        16,384 tokens per step), not the async engine's 128 / 2,048, which keep the GPU short of work and make the
        pipeline incomparable with vLLM's own offline batch inference."""
        async def start():
            return v.AsyncLLM.from_engine_args(engine_args, usage_context=v.UsageContext.LLM_CLASS)

        llm = self.call(start(), timeout)
        self._answer_one_token(v, llm, timeout)
        return llm

    def _answer_one_token(self, v: SimpleNamespace, llm, timeout: float) -> None:
        """One one-token text request through the engine just started. An engine can build and profile a model
        and still fail its first real step: vLLM 0.26 started Qwen3.5 with FlashInfer's Gated DeltaNet kernel
        missing and died at the first prefill (seen on an H200). Then it fails here, at start, with a
        clear error, instead of on the first batch of work."""
        params = v.SamplingParams(max_tokens=1, temperature=0.0, output_kind=v.RequestOutputKind.FINAL_ONLY)

        async def answer():
            async for _ in llm.generate(START_CHECK_PROMPT, params, "vlmstream-start-check"):
                pass

        try:
            self.call(answer(), timeout)
        except Exception as exc:
            with contextlib.suppress(Exception):
                self.shutdown_llm(llm, timeout=60)
            self.reap_children()
            raise EngineCannotRun(
                f"vLLM {v.version} started the engine but it failed a one-token text request at start "
                f"({type(exc).__name__}: {str(exc)[:300]}); the engine process's log above has the cause, often "
                f"a kernel this install lacks") from exc

    def shutdown_llm(self, llm, timeout: float = 120) -> None:
        """Cancel the loop's tasks (requests in flight) and shut the engine down."""
        async def shutdown():
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()
            llm.shutdown()

        self.call(shutdown(), timeout)

    def stop(self) -> None:
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)

    def reap_children(self) -> None:
        """vLLM's shutdown normally ends its EngineCore; an orphan would hold the GPU until killed, so any child
        process started since this loop was made and still alive is ended here."""
        for child in multiprocessing.active_children():
            if child.pid in self._children_before:
                continue
            child.join(timeout=10)
            if child.is_alive():
                log.warning("terminating leftover vLLM process %s (pid %s)", child.name, child.pid)
                child.terminate()
                child.join(timeout=10)
            if child.is_alive():
                child.kill()
                child.join(timeout=5)

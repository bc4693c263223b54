"""Every hook into a vLLM internal, in one place, with the vLLM release it was checked against.

vlmstream drives vLLM through its public engine API (``AsyncLLM``, ``AsyncEngineArgs``, ``SamplingParams``,
``collective_rpc``, ``worker_extension_cls``) wherever that API reaches. The hooks below reach past it to run our tower
inside vLLM's engine process (one CUDA context; each image crosses as its uint8 rows, about a third of the bytes of its
Qwen2.5-VL embeddings), which no public API offers. On any other release the tower runs in the consumer and hands vLLM
``image_embeds`` through the public ``enable_mm_embeds``; docs/benchmarks.md measures the two against each other. The
hooks rely on names vLLM may change in any release, so they were checked against CHECKED_VLLM, and on any other
release the code that needs them is not used (``version_problem`` says why):

- ``wrap_image_inputs``: the Qwen model classes in ``vllm.model_executor.models`` (MODEL_CLASSES) run their vision
  tower in ``_process_image_input(self, image_input)``, where ``image_input`` is a dict with ``type``,
  ``image_embeds`` or ``pixel_values``, and ``image_grid_thw``, and the method returns one tensor per image. Our
  tower in vLLM's engine process (consumers/infer/engine_tower.py) replaces that method.
- ``built_model``: a worker's ``model_runner.get_model()`` is the model vLLM built, possibly inside a CUDA graph
  wrapper that ``unwrap()`` opens.
- ``model_dtype``: vLLM's model objects carry the engine's ``model_config``, whose ``dtype`` the model runs in.
- ``flash_attention_3_varlen``: vLLM bundles FlashAttention 3 as ``vllm.vllm_flash_attn.flash_attn_interface``
  (``flash_attn_varlen_func`` with ``fa_version``, ``is_fa_version_supported``), a module of its own build, not its
  API; our tower's fast blocks use its varlen kernel.
- ``cold_compile_seconds``: vLLM's engine log at start, ``init engine (...) took X s (compilation: Y s)``, and
  ``Compiling a graph for ...`` where it compiled the model rather than loading its compile cache; read by
  `vlmstream estimate`, whose sample may fill a cache the run then loads.
- ``registered_models``: vLLM's private registry table ``vllm.model_executor.models.registry._VLLM_MODELS``
  (architecture -> (module under ``vllm.model_executor.models``, class)), read only to explain a start failure.

Nothing here imports vLLM at module import: the CPU install has none.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import re
from collections.abc import Callable

from vlmstream.extras import install_command

log = logging.getLogger(__name__)

# The vLLM release the hooks below were read against. pyproject.toml's ``gpu`` extra pins its release series
# (``vllm>=0.34,<0.35``); patch releases of one series keep these names.
CHECKED_VLLM = "0.34.0"
INSTALL_HINT = install_command("gpu")

MODELS_PACKAGE = "vllm.model_executor.models"
# vLLM's Qwen model classes whose ``_process_image_input(self, image_input)`` runs the tower on image inputs. Qwen3-VL
# MoE and Qwen3.5 (dense and MoE) subclass Qwen3VLForConditionalGeneration and inherit the replaced method.
MODEL_CLASSES = (
    (f"{MODELS_PACKAGE}.qwen2_vl", "Qwen2VLForConditionalGeneration"),
    (f"{MODELS_PACKAGE}.qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    (f"{MODELS_PACKAGE}.qwen3_vl", "Qwen3VLForConditionalGeneration"),
)
# The attribute a wrapped method carries, so that wrapping twice wraps once and a built model's class can be asked.
WRAPPED_MARK = "vlmstream_tower"


def installed_vllm() -> str | None:
    """The installed vLLM release, or None without vLLM."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def _series(version: str) -> tuple[str, ...]:
    return tuple(version.split("+")[0].split(".")[:2])


def version_problem(installed: str | None = None) -> str | None:
    """Why the hooks here cannot be used with the vLLM release ``installed`` (the installed one by default), or None
    when it is of CHECKED_VLLM's release series."""
    installed = installed if installed is not None else installed_vllm()
    if installed is None:
        return f"vLLM is not installed ({INSTALL_HINT} installs vLLM {CHECKED_VLLM}'s series)"
    if _series(installed) != _series(CHECKED_VLLM):
        return (f"vLLM {installed} is installed, and vlmstream's hooks into vLLM internals were checked against "
                f"vLLM {CHECKED_VLLM} ({INSTALL_HINT} installs that release series)")
    return None


def wrap_image_inputs(wrap: Callable[[Callable], Callable], classes=MODEL_CLASSES) -> list[str]:
    """Replace each of ``classes``' (module, class name) ``_process_image_input`` with ``wrap(original)``; the names
    of the classes whose method is now wrapped. A class already wrapped is left as it is; one that is not there is
    skipped with a warning (its model keeps vLLM's own method)."""
    wrapped = []
    for module_name, class_name in classes:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
        except (ImportError, AttributeError) as exc:
            log.warning("%s.%s is not there (%s); its model keeps vLLM's own image path", module_name, class_name,
                        exc)
            continue
        if not getattr(cls._process_image_input, WRAPPED_MARK, None):
            replacement = wrap(cls._process_image_input)
            setattr(replacement, WRAPPED_MARK, "vlmstream")
            cls._process_image_input = replacement
        wrapped.append(class_name)
    return wrapped


# vLLM's engine, once started: "init engine (profile, create kv cache, warmup model) took 44.84 s (compilation: 21.61 s)";
# 0.34 adds " — language_model: X s, encoder: Y s" inside the brackets where it compiled a tower too, and leaves the
# brackets out where it compiled nothing. Where it compiled rather than loaded its cache, also "Compiling a graph for
# compile range (1, 16384) takes 10.66 s".
_ENGINE_STARTED = re.compile(r"init engine \([^)]*\) took [\d.]+ s(?: \(compilation: ([\d.]+) s)?")
_COMPILED_COLD = "Compiling a graph for"


def cold_compile_seconds(log_text: str) -> float | None:
    """The seconds vLLM's engines compiled the model for at their start, from their log (0.0 where each loaded its
    compile cache instead); None where the log holds no engine start of the form CHECKED_VLLM writes."""
    started = _ENGINE_STARTED.findall(log_text)
    if not started:
        return None
    return sum(float(s or 0) for s in started) if _COMPILED_COLD in log_text else 0.0


def built_model(worker):
    """The model a vLLM worker built (outside any CUDA graph wrapper: vLLM's runners unwrap some, not all)."""
    model = worker.model_runner.get_model()
    return model.unwrap() if hasattr(model, "unwrap") else model


def takes_wrapper(model) -> bool:
    """Whether ``model``'s image inputs go through a method ``wrap_image_inputs`` replaced (its class or a base)."""
    return bool(getattr(getattr(type(model), "_process_image_input", None), WRAPPED_MARK, None))


def model_dtype(model):
    """The torch dtype a model vLLM built runs in."""
    return model.model_config.dtype


def flash_attention_3_varlen():
    """vLLM's FlashAttention 3 varlen kernel as ``kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale)`` (non-causal;
    q, k, v as (tokens, heads, head_dim)). Raises RuntimeError where it cannot be used: another vLLM release than
    the checked one, none, or a device FlashAttention 3 does not support."""
    problem = version_problem()
    if problem:
        raise RuntimeError(problem)
    from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func, is_fa_version_supported

    if not is_fa_version_supported(3):
        raise RuntimeError("vLLM's FlashAttention 3 is not supported on this device")

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        # fa_version is explicit: vLLM's default is FA2, whose library the device bundle leaves out.
        return flash_attn_varlen_func(q, k, v, max_seqlen_q=max_q, cu_seqlens_q=cu_q, max_seqlen_k=max_k,
                                      cu_seqlens_k=cu_k, softmax_scale=scale, causal=False, fa_version=3)

    return kernel


def registered_models() -> dict | None:
    """vLLM's registry of architectures: architecture -> (module under MODELS_PACKAGE, class); None without vLLM or
    where the table is not there."""
    try:
        from vllm.model_executor.models.registry import _VLLM_MODELS
    except Exception:  # noqa: BLE001 - no vLLM, or one without that table: nothing to read
        return None
    return _VLLM_MODELS

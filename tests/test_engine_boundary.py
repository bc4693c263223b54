"""The boundary to vLLM's engine process: the one adapter that touches vLLM's internals (vlmstream/vllm_adapter.py)
and the one object that carries the consumer's decisions to our tower there (consumers/infer/engine_boundary.py).
vLLM is not needed: the adapter's hooks are exercised on plain classes defined here, and the engine side's reader
runs in a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

from consumers.infer.engine_boundary import ENVIRONMENT_VARIABLE, VLLM_LARGEST_DEFAULT_BATCH, EngineTowerConfig
from vlmstream import vllm_adapter
from vlmstream.config import InferSettings
from vlmstream.models.qwen2_vl import QWEN2_VL

REPO = Path(__file__).resolve().parents[1]


def built(**settings) -> EngineTowerConfig:
    return EngineTowerConfig.for_engine("/models/qwen", QWEN2_VL, InferSettings(**settings), "0.26.0")


def test_the_consumer_builds_the_engine_towers_config_from_its_settings():
    """What the consumer decided: its family, whether embeddings are kept, and twice its in-flight bound as the
    engine's keep (the engine's batch taken as vLLM's largest default when infer.max_num_seqs leaves it open)."""
    config = built()
    assert (config.family, config.checkpoint, config.vllm_version, config.keep_embeddings) == (
        QWEN2_VL.name, "/models/qwen", "0.26.0", True)
    assert config.embeddings_kept_at_most == 2 * max(256, 2 * VLLM_LARGEST_DEFAULT_BATCH)
    assert built(max_images_in_flight=300).embeddings_kept_at_most == 600
    assert built(max_num_seqs=64).embeddings_kept_at_most == 2 * 256
    assert built(publish_embeddings=False).keep_embeddings is False
    with pytest.raises(Exception, match="frozen"):
        config.family = "other"


def test_the_config_crosses_as_one_environment_variable_and_back():
    config = built(max_images_in_flight=100)
    environment = config.environment()
    assert list(environment) == [ENVIRONMENT_VARIABLE]
    assert EngineTowerConfig.from_environment(environment) == config


def test_a_missing_malformed_or_extra_field_is_refused_with_the_variables_name():
    fields = json.loads(built().model_dump_json())
    with pytest.raises(RuntimeError, match=f"{ENVIRONMENT_VARIABLE} is not set"):
        EngineTowerConfig.from_environment({})
    missing = {k: v for k, v in fields.items() if k != "embeddings_kept_at_most"}
    with pytest.raises(RuntimeError, match="embeddings_kept_at_most"):
        EngineTowerConfig.from_environment({ENVIRONMENT_VARIABLE: json.dumps(missing)})
    with pytest.raises(RuntimeError, match="tower_clock"):
        EngineTowerConfig.from_environment({ENVIRONMENT_VARIABLE: json.dumps({**fields, "tower_clock": True})})
    with pytest.raises(RuntimeError, match="not a valid EngineTowerConfig"):
        EngineTowerConfig.from_environment({ENVIRONMENT_VARIABLE: "{not json"})
    with pytest.raises(RuntimeError, match="embeddings_kept_at_most"):
        EngineTowerConfig.from_environment({ENVIRONMENT_VARIABLE: json.dumps({**fields, "embeddings_kept_at_most": 0})})


def _engine_side(environment: dict[str, str]) -> subprocess.CompletedProcess:
    """engine_tower's reader in a fresh interpreter, as vLLM's spawned engine process runs it."""
    code = "from consumers.infer import engine_tower; print(engine_tower.config().model_dump_json())"
    env = {k: v for k, v in os.environ.items() if k != ENVIRONMENT_VARIABLE}
    env.update(environment, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_the_engine_side_reads_exactly_what_the_consumer_built_in_its_own_process():
    config = built(max_images_in_flight=123, publish_embeddings=False)
    done = _engine_side(config.environment())
    assert done.returncode == 0, done.stderr
    assert EngineTowerConfig.model_validate_json(done.stdout.strip().splitlines()[-1]) == config
    done = _engine_side({})
    assert done.returncode != 0 and f"{ENVIRONMENT_VARIABLE} is not set" in done.stderr


def test_the_adapter_names_the_vllm_release_its_hooks_were_checked_against():
    """The checked release is of the series the gpu extra pins; another series, or none, is a reason naming both
    releases and the install command."""
    gpu = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    major, minor, _ = vllm_adapter.CHECKED_VLLM.split(".")
    assert f"vllm>={major}.{minor},<{major}.{int(minor) + 1}" in gpu
    assert vllm_adapter.version_problem(vllm_adapter.CHECKED_VLLM) is None
    assert vllm_adapter.version_problem(f"{major}.{minor}.7") is None  # a patch release of the checked series
    problem = vllm_adapter.version_problem("0.27.0")
    assert "0.27.0" in problem and vllm_adapter.CHECKED_VLLM in problem and vllm_adapter.INSTALL_HINT in problem
    if vllm_adapter.installed_vllm() is None:
        assert "not installed" in vllm_adapter.version_problem()
        with pytest.raises(RuntimeError, match="not installed"):  # the tower's blocks then take another kernel
            vllm_adapter.flash_attention_3_varlen()


class ModelWithATower:
    """A model class with the method vLLM's Qwen classes have."""

    def _process_image_input(self, image_input):
        return ("own", image_input)


class ModelWithTheTowerInherited(ModelWithATower):
    pass


def test_the_adapter_wraps_a_classes_image_inputs_once_and_skips_a_missing_one(monkeypatch, caplog):
    original = ModelWithATower._process_image_input
    monkeypatch.setattr(ModelWithATower, "_process_image_input", original)  # undone after the test

    def wrap(inner):
        def _process_image_input(self, image_input):
            return ("ours", inner(self, image_input))
        return _process_image_input

    with caplog.at_level("WARNING", logger=vllm_adapter.__name__):
        assert vllm_adapter.wrap_image_inputs(wrap, [(__name__, "ModelWithATower"), ("no_such_module", "X")]) == [
            "ModelWithATower"]
    assert any("no_such_module.X" in r.getMessage() for r in caplog.records)
    assert vllm_adapter.wrap_image_inputs(wrap, [(__name__, "ModelWithATower")]) == ["ModelWithATower"]
    assert ModelWithTheTowerInherited()._process_image_input(1) == ("ours", ("own", 1))  # wrapped once, inherited
    assert vllm_adapter.takes_wrapper(ModelWithTheTowerInherited())
    assert not vllm_adapter.takes_wrapper(object())


def test_the_adapter_finds_the_model_a_worker_built_inside_a_graph_wrapper():
    model = ModelWithATower()
    model.model_config = types.SimpleNamespace(dtype="bfloat16")
    worker = types.SimpleNamespace(model_runner=types.SimpleNamespace(get_model=lambda: model))
    assert vllm_adapter.built_model(worker) is model
    wrapped = types.SimpleNamespace(unwrap=lambda: model)
    worker.model_runner = types.SimpleNamespace(get_model=lambda: wrapped)
    assert vllm_adapter.built_model(worker) is model
    assert vllm_adapter.model_dtype(model) == "bfloat16"


# vLLM 0.26.0's own lines (an H100, Qwen2.5-VL-7B's config): an engine that compiled, then one that loaded the cache.
COLD_START = """\
(EngineCore pid=1097) INFO 12-06 01:33:45 [backends.py:393] Compiling a graph for compile range (1, 16384) takes 10.66 s
(EngineCore pid=1097) INFO 12-06 01:33:49 [monitor.py:53] torch.compile took 21.61 s in total
(EngineCore pid=1097) INFO 12-06 01:34:10 [core.py:340] init engine (profile, create kv cache, warmup model) took \
44.84 s (compilation: 21.61 s)
"""
WARM_START = """\
(EngineCore pid=1496) INFO 12-06 01:35:04 [backends.py:292] Directly load the compiled graph(s) for compile range \
(1, 16384) from the cache, took 1.480 s
(EngineCore pid=1496) INFO 12-06 01:35:04 [monitor.py:53] torch.compile took 3.77 s in total
(EngineCore pid=1496) INFO 12-06 01:35:23 [core.py:340] init engine (profile, create kv cache, warmup model) took \
23.79 s (compilation: 3.77 s)
"""


def test_the_adapter_reads_how_long_vllms_engine_compiled_at_its_start():
    assert vllm_adapter.cold_compile_seconds(COLD_START) == pytest.approx(21.61)
    assert vllm_adapter.cold_compile_seconds(WARM_START) == 0.0  # it loaded the cache the first one filled
    assert vllm_adapter.cold_compile_seconds("loading the tiny model on the CPU\n") is None


# vLLM 0.34.0's lines (an H100, Qwen2.5-VL-7B's config, our tower in its engine), then the forms its format strings
# (v1/engine/core.py) give with a compiled encoder (the compile split in the brackets) and with nothing compiled.
COLD_START_034 = """\
(EngineCore pid=2681) INFO 12-06 04:49:55 [backends.py:421] [backbone] Compiling a graph for compile range (1, 16384) \
takes 15.29 s
(EngineCore pid=2681) INFO 12-06 04:50:41 [core.py:451] init engine (profile, create kv cache, warmup model) took \
75.45 s (compilation: 31.63 s)
"""
COLD_START_WITH_ENCODER = """\
(EngineCore pid=88) INFO 12-06 05:01:02 [backends.py:422] Compiling a graph for compile range (1, 8192) takes 9.10 s
(EngineCore pid=88) INFO 12-06 05:01:30 [core.py:441] init engine (profile, create kv cache, warmup model) took \
40.12 s (compilation: 25.50 s \u2014 language_model: 20.00 s, encoder: 5.50 s)
"""
NOTHING_COMPILED = """\
(EngineCore pid=90) INFO 12-06 05:03:00 [core.py:456] init engine (profile, create kv cache, warmup model) took 12.00 s
"""


def test_the_adapter_reads_the_compile_seconds_in_each_form_vllm_writes_them():
    assert vllm_adapter.cold_compile_seconds(COLD_START_034) == pytest.approx(31.63)
    assert vllm_adapter.cold_compile_seconds(COLD_START_WITH_ENCODER) == pytest.approx(25.5)
    assert vllm_adapter.cold_compile_seconds(NOTHING_COMPILED) == 0.0
    assert vllm_adapter.cold_compile_seconds(COLD_START + WARM_START) == pytest.approx(21.61 + 3.77)

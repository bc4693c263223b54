"""Test tiers: pure stage tests need nothing; `kafka` tests share one real local broker per session
(started here through the project's own broker module, reused when `.ci/run` already started it);
`model` tests build the tiny random-weight Qwen2.5-VL on CPU; `gpu` tests run on the device only.
Every test that uses a broker fixture is marked `kafka` here, so `-m "not kafka"` never reaches for a broker.
"""

from __future__ import annotations

import importlib
import os
import uuid
from pathlib import Path

import pytest

from vlmstream.config import Settings, load_settings

REPO = Path(__file__).resolve().parents[1]
BROKER_FIXTURES = frozenset({"kafka_settings", "topic_names"})
CORPUS_CANDIDATES = [os.environ.get("VLMSTREAM_TEST_IMAGES", ""), str(REPO.parent / "shared" / "corpus")]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark `kafka` every test that reaches the broker through a fixture. ``fixturenames`` is the closure: a
    fixture that depends on ``topic_names`` (a module's own ``settings``) brings it in too."""
    for item in items:
        if BROKER_FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.kafka)


@pytest.fixture(scope="session")
def kafka_settings() -> Settings:
    """Settings pointing at the real broker (local one started on demand, or VLMSTREAM_BOOTSTRAP_SERVERS)."""
    from vlmstream.broker.lifecycle import ensure_broker

    settings = load_settings()
    ensure_broker(settings)
    return settings


@pytest.fixture
def topic_names(kafka_settings: Settings):
    """Fresh uuid-named topics for one test, so tests never see each other's messages."""
    from tests.kafka_helpers import create_uuid_topics

    topics = create_uuid_topics(kafka_settings)
    yield topics
    from tests.kafka_helpers import delete_topics

    delete_topics(kafka_settings, topics)


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    """A folder of real images: $VLMSTREAM_TEST_IMAGES, else ../shared/corpus, else images generated here."""
    for candidate in CORPUS_CANDIDATES:
        if candidate and Path(candidate).is_dir() and any(Path(candidate).rglob("*.*")):
            return Path(candidate)
    from tests.images import generated_corpus

    return generated_corpus()


@pytest.fixture
def unique() -> str:
    return uuid.uuid4().hex[:12]


@pytest.fixture(scope="module")
def engine():
    """One real TransformersEngine (tiny model) for the in-process runs of a module (the inference runner's tests,
    replay's): loading it is the slow part."""
    from tests.helpers import real_engine

    settings = load_settings()
    instance = real_engine(settings.model_copy(update={"infer": settings.infer.model_copy(
        update={"batch_size": 4, "max_new_tokens": 8})}))
    yield instance
    instance.close()


def _interpreted(monkeypatch, module: str, launcher: str):
    """A Triton kernel's module with its launcher built for Triton's CPU interpreter (the same kernel source the GPU
    compiles), the launcher's cache emptied before and after."""
    pytest.importorskip("triton")
    kernels = importlib.import_module(f"consumers.infer.vision.{module}")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    getattr(kernels, launcher).cache_clear()
    yield kernels
    getattr(kernels, launcher).cache_clear()


@pytest.fixture
def interpreted_triton(monkeypatch):
    """The Triton q/k/v kernel's module (``qkv_rotary``), built for the CPU interpreter."""
    yield from _interpreted(monkeypatch, "qkv_rotary", "triton_rotate_qkv")


@pytest.fixture
def interpreted_norm_kernels(monkeypatch):
    """The Triton norm kernels' module (``block_norm``), built for the CPU interpreter."""
    yield from _interpreted(monkeypatch, "block_norm", "triton_kernels")


@pytest.fixture
def interpreted_mlp_kernels(monkeypatch):
    """The Triton MLP activation kernels' module (``mlp_activation``), built for the CPU interpreter."""
    yield from _interpreted(monkeypatch, "mlp_activation", "triton_kernels")


@pytest.fixture
def engine_tower_config(monkeypatch):
    """engine_tower as vLLM's engine process runs it: configured by the consumer (``EngineTowerConfig.for_engine``,
    through its environment variable), read afresh by this test. Call it with the checkpoint folder."""
    from consumers.infer import engine_tower
    from consumers.infer.engine_boundary import EngineTowerConfig
    from vlmstream import vllm_adapter
    from vlmstream.config import InferSettings
    from vlmstream.models.registry import family_of

    def configure(checkpoint, **settings) -> EngineTowerConfig:
        built = EngineTowerConfig.for_engine(str(checkpoint), family_of(checkpoint), InferSettings(**settings),
                                             vllm_adapter.CHECKED_VLLM)
        for name, value in built.environment().items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(engine_tower, "_config", None)
        monkeypatch.setattr(engine_tower, "_tap", None)
        return built

    return configure

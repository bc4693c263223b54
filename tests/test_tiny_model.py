"""The built-in tiny Qwen2.5-VL: written locally, loadable offline by the stock transformers classes,
deterministic, with the real special-token ids."""

from __future__ import annotations

import hashlib
import json

import pytest

from consumers.infer.tiny_model import IMAGE_PAD_ID, SPECIAL_TOKENS, default_tiny_model_dir

pytestmark = pytest.mark.model


def _digest(path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    home = tmp_path_factory.mktemp("vlmstream-home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLMSTREAM_HOME", str(home))
        first = default_tiny_model_dir()
        marker_mtime = (first / "vlmstream-tiny-model.json").stat().st_mtime_ns
        again = default_tiny_model_dir()
    assert again == first == home / "tiny-qwen2.5-vl"
    assert (first / "vlmstream-tiny-model.json").stat().st_mtime_ns == marker_mtime, "second call rewrote the model"
    return first


def test_loads_offline_with_stock_transformers_classes(tiny_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_dir)
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert type(processor.image_processor).__name__ == "Qwen2VLImageProcessor"
    tokenizer = processor.tokenizer
    assert [tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(151643, 151657))
    assert tokenizer.convert_tokens_to_ids("<|image_pad|>") == IMAGE_PAD_ID == model.config.image_token_id
    # The text fields sit at the top level too, as in the released checkpoint vLLM reads.
    raw = json.loads((tiny_dir / "config.json").read_text())
    assert raw["vocab_size"] >= 151657 and raw["text_config"]["hidden_size"] == raw["vision_config"]["out_hidden_size"]
    assert max(raw["vision_config"]["fullatt_block_indexes"]) < raw["vision_config"]["depth"]
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params < 15_000_000, n_params


def test_cli_writes_the_same_weights(tiny_dir, tmp_path):
    """`vlmstream tiny-model PATH` writes a byte-identical checkpoint: the model is a fixed seed, not a draw."""
    from typer.testing import CliRunner

    from vlmstream.cli.main import app

    result = CliRunner().invoke(app, ["tiny-model", str(tmp_path / "tiny")])
    assert result.exit_code == 0, result.output
    assert _digest(tmp_path / "tiny") == _digest(tiny_dir)
    for name in ("tokenizer.json", "config.json", "preprocessor_config.json", "generation_config.json"):
        assert (tmp_path / "tiny" / name).read_bytes() == (tiny_dir / name).read_bytes(), name

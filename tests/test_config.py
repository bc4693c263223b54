"""Typed settings: defaults < file < environment < flags, secrets never printed, and a value the clients cannot
use refused when the settings are read, not when a worker first talks to the broker."""

from __future__ import annotations

import json

import pydantic
import pytest

from vlmstream.config import load_settings


def test_layers_apply_in_order_and_secrets_stay_masked(tmp_path, monkeypatch):
    config = tmp_path / "vlmstream.json"
    config.write_text(json.dumps({"kafka": {"sasl_plain_password": "hunter2", "client_id": "from-file"},
                                  "producer": {"linger_ms": 7, "compression_type": "gzip"}}))
    monkeypatch.setenv("VLMSTREAM_PRODUCER__COMPRESSION_TYPE", "zstd")
    settings = load_settings(config, overrides={"producer": {"linger_ms": 9, "compression_type": None}})
    assert (settings.kafka.client_id, settings.producer.compression_type, settings.producer.linger_ms) == \
        ("from-file", "zstd", 9)
    assert "hunter2" not in settings.masked_json() and "hunter2" not in repr(settings)
    assert settings.kafka.client_kwargs()["sasl_plain_password"] == "hunter2"


def test_a_compression_codec_kafka_does_not_have_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("VLMSTREAM_PRODUCER__COMPRESSION_TYPE", "zstandard")
    with pytest.raises(pydantic.ValidationError, match="compression_type"):
        load_settings()


def test_settings_variables_are_told_from_process_variables():
    """`vlmstream run` hands its children the effective settings in a file and strips the settings variables from
    their environment (they would outrank the file); process variables stay."""
    from vlmstream.config import is_settings_variable

    for key in ("VLMSTREAM_TOPICS__DOCUMENTS", "VLMSTREAM_DECODE__GROUP_ID", "VLMSTREAM_METRICS_PORT",
                "VLMSTREAM_BOOTSTRAP_SERVERS", "VLMSTREAM_CONFIG", "VLMSTREAM_KAFKA__SECURITY_PROTOCOL"):
        assert is_settings_variable(key), key
    for key in ("VLMSTREAM_HOME", "VLMSTREAM_PROFILE_OUT", "VLMSTREAM_KAFKA_LOG_LEVEL", "PATH", "OMP_NUM_THREADS"):
        assert not is_settings_variable(key), key

"""`vlmstream estimate` end to end: a heavy-tailed manifest, its sample run through `vlmstream run` on the real broker
with the tiny model, and the JSON line scripts hold against the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import corpus_images

pytestmark = [pytest.mark.kafka, pytest.mark.model, pytest.mark.slow]


def test_estimate_samples_the_heavy_tail_runs_it_and_ends_with_one_json_line(kafka_settings, corpus_dir, tmp_path,
                                                                             unique):
    images = [str(p) for p in corpus_images(corpus_dir, 12)]
    sizes = [1] * 20 + [2] * 6 + [12]  # the heavy document is the tail a document-rate estimate misses
    manifest = tmp_path / "job.jsonl"
    with manifest.open("w") as handle:
        for n, size in enumerate(sizes):
            uris = [images[(n + i) % len(images)] for i in range(size)]
            handle.write(json.dumps({"doc_id": f"{unique}-{n}", "image_uris": uris}) + "\n")
    env = {"VLMSTREAM_INFER__BATCH_SIZE": "4", "OMP_NUM_THREADS": "1",
           "VLMSTREAM_PRODUCER__STATE_DIR": str(tmp_path / "ledger")}
    cmd = [sys.executable, "-m", "vlmstream.cli", "estimate", str(manifest), "--sample-images", "10",
           "--decode-workers", "1", "--max-pixels", str(64 * 28 * 28), "--max-new-tokens", "2", "--json",
           "--gpus", "2", "--decode-cores", "4"]
    proc = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = proc.stdout.strip().splitlines()[-1]
    data = json.loads(last)
    assert data["images"] == sum(sizes) and data["documents"] == len(sizes)
    assert 0 < data["low_s"] <= data["predicted_s"] <= data["high_s"]
    assert data["bottleneck"] in ("decode", "inference")
    assert data["sample_images"] < sum(sizes)
    assert 0 < data["warmup_s"] < data["sample_wall_s"]
    # The heavy document's stratum is in the sample, and the scaling for --gpus/--decode-cores is said.
    assert 12 in data["sample_images_per_document"] and 1 in data["sample_images_per_document"]
    assert any("2 GPU" in line for line in data["scaled"]) and any("4 decode" in line for line in data["scaled"])
    assert "assumptions and what the estimate could not see" in proc.stderr

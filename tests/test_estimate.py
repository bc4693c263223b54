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
    # On the CPU both stages' costs are CPU time, and the estimate says so.
    assert data["cost_kinds"] == {"decode": "cpu", "inference": "cpu"}
    assert any("inference, the inference process's CPU time over each batch" in line for line in data["assumptions"])


def test_estimate_of_a_topic_backlog_leaves_the_real_group_where_it_was(topic_names, corpus_dir, tmp_path, unique):
    """The job's topics and group named in the environment (as a deployment does) must not reach the sample's
    workers: the backlog is read, sampled onto topics of its own, and still waits for the real decode group."""
    from producers.publisher import publish_documents
    from schemas import DocumentRef
    from vlmstream.cli.status import pipeline_status

    decode = topic_names.decode.model_copy(update={"group_id": f"test-decode-{unique}"})
    settings = topic_names.model_copy(update={"decode": decode, "producer": topic_names.producer.model_copy(
        update={"state_dir": str(tmp_path / "ledger")})})
    images = [str(p) for p in corpus_images(corpus_dir, 3)]
    docs = [DocumentRef(doc_id=f"{unique}-{n}", image_uris=tuple(images[:n])) for n in (1, 2, 3)]
    assert publish_documents(settings, docs).sent == 3
    env = {**os.environ, "OMP_NUM_THREADS": "1", "VLMSTREAM_INFER__BATCH_SIZE": "2",
           "VLMSTREAM_TOPICS__DOCUMENTS": settings.topics.documents, "VLMSTREAM_DECODE__GROUP_ID": decode.group_id,
           "VLMSTREAM_DECODE__ALLOWED_ROOTS": json.dumps([str(corpus_dir)])}
    cmd = [sys.executable, "-m", "vlmstream.cli", "estimate", "--topic", "--sample-images", "2", "--max-pixels",
           str(64 * 28 * 28), "--max-new-tokens", "2", "--json"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (data["documents"], data["images"]) == (3, 6)
    by = {s.stage: s for s in pipeline_status(settings)[0]}
    assert (by["decode"].lag, by["decode"].images) == ({settings.topics.documents: 3}, 6)


def test_estimate_with_condense_runs_the_condense_stage_in_its_sample(kafka_settings, corpus_dir, tmp_path, unique):
    """`run --condense` also condenses each document; the estimate runs the condense worker in its sample, measures
    its time per document, and says how it counted it."""
    images = [str(p) for p in corpus_images(corpus_dir, 3)]
    manifest = tmp_path / "job.jsonl"
    manifest.write_text("".join(json.dumps({"doc_id": f"{unique}-{n}", "image_uris": [uri]}) + "\n"
                                for n, uri in enumerate(images)))
    env = {**os.environ, "VLMSTREAM_INFER__BATCH_SIZE": "2", "OMP_NUM_THREADS": "1",
           "VLMSTREAM_PRODUCER__STATE_DIR": str(tmp_path / "ledger")}
    cmd = [sys.executable, "-m", "vlmstream.cli", "estimate", str(manifest), "--condense", "--sample-images", "2",
           "--decode-workers", "1", "--max-pixels", str(64 * 28 * 28), "--max-new-tokens", "2", "--json"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    data = json.loads(proc.stdout.strip().splitlines()[-1])
    assert data["stages"] == ["decode", "inference", "condense"]
    assert data["condense_s_per_document"] > 0
    said = next(line for line in data["assumptions"] if line.startswith("--condense"))
    assert f"{data['sample_documents']} of {data['sample_documents']} documents answered" in said
    assert data["images"] == 3 and data["predicted_s"] > 0 and data["sample_missing"] == 0

"""The README's main command end to end (`vlmstream run` on a folder), and the local broker's lifecycle."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from schemas import Description, DocumentResult
from tests.helpers import REPO, run_env
from tests.kafka_helpers import read_topic
from vlmstream.broker import lifecycle
from vlmstream.config import Settings

pytestmark = pytest.mark.kafka


def test_second_start_reuses_the_running_broker(kafka_settings: Settings):
    if not kafka_settings.uses_local_broker:
        pytest.skip("VLMSTREAM_BOOTSTRAP_SERVERS points at another cluster")
    before = lifecycle.status(kafka_settings)
    assert before["answers"] is True
    assert lifecycle.start(kafka_settings) == f"{kafka_settings.broker.host}:{kafka_settings.broker.port}"
    after = lifecycle.status(kafka_settings)
    assert after["pid"] == before["pid"], "a second start must reuse the running broker, not start another"


def _folder_of_documents(root: Path, corpus: Path) -> dict[str, int]:
    images = sorted(p for p in corpus.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png", ".webp"))[:5]
    layout = {"doc-a": images[:2], "doc-b": images[2:5] or images[:1]}
    for doc, files in layout.items():
        (root / doc).mkdir(parents=True)
        for index, path in enumerate(files):
            shutil.copy(path, root / doc / f"{index:02d}{path.suffix.lower()}")
    (root / "doc-b" / "99-broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 this is not really a JPEG")
    return {doc: len(list((root / doc).iterdir())) for doc in layout}


@pytest.mark.model
@pytest.mark.slow
def test_run_describes_every_image_of_a_folder_and_reports_each_document(topic_names: Settings, corpus_dir,
                                                                          tmp_path, unique):
    folder = tmp_path / "docs"
    expected = _folder_of_documents(folder, corpus_dir)
    t = topic_names.topics
    env = run_env(topic_names, tmp_path, f"run-{unique}", 3)
    run_cmd = [sys.executable, "-m", "vlmstream.cli", "run", str(folder), "--decode-workers", "1",
               "--max-pixels", str(128 * 28 * 28), "--max-new-tokens", "4", "--timeout-s", "400"]
    proc = subprocess.run(run_cmd, env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "vlmstream run" in proc.stderr  # the summary table
    # The live view while it waited: a line per stage in images, and the stage that limits the run.
    assert "  decode " in proc.stderr and "  inference " in proc.stderr and "bottleneck: " in proc.stderr
    # (decode's total is the images the documents name, the broken one (a dead letter) too, and never more)
    assert re.search(rf"decode +{sum(expected.values())}/{sum(expected.values())} images", proc.stderr), \
        proc.stderr[-3000:]
    totals = [int(n) for n in re.findall(r"decode +\d+/(\d+) images", proc.stderr)]
    assert totals and max(totals) == sum(expected.values()), totals
    # The last line, once every result is in, shows no image still waiting for inference (its group's commits
    # trail the descriptions).
    done, total = re.findall(r"inference +(\d+)/(\d+) images", proc.stderr)[-1]
    assert done == total, proc.stderr[-3000:]

    results = {}
    for record in read_topic(topic_names, t.results, expected=len(expected), timeout_s=60):
        result = DocumentResult.decode(record.value)
        results[result.doc_id] = result
    assert set(results) == set(expected)
    for doc, count in expected.items():
        assert results[doc].image_count == count
        assert results[doc].succeeded + results[doc].failed == count
    broken = [image for image in results["doc-b"].images if image["status"] == "failed"]
    assert len(broken) == 1 and broken[0]["stage"] == "decode", results["doc-b"].images
    assert results["doc-a"].failed == 0

    descriptions = [Description.decode(r.value) for r in read_topic(topic_names, t.descriptions, timeout_s=30)]
    described = {(d.doc_id, d.image_index) for d in descriptions}
    assert len(described) == sum(expected.values()) - 1

    # Again with --force: every document is described again, and the run waits for the new results (it used to
    # count the first run's and stop the workers before they had redone anything).
    again = subprocess.run(run_cmd + ["--force"], env=env, capture_output=True, text=True, timeout=480)
    assert again.returncode == 0, again.stderr[-4000:]
    counts = Counter((d.doc_id, d.image_index) for d in
                     (Description.decode(r.value) for r in read_topic(topic_names, t.descriptions, timeout_s=30)))
    assert set(counts) == described and min(counts.values()) >= 2, counts

    # Then with another model and no --force: the documents' results all came from the built-in model, so the run
    # publishes them again and waits for this model's results; a rerun with the same model then resumes.
    from consumers.infer.tiny_model import write_tiny_model

    other = str(write_tiny_model(tmp_path / "other-model", seed=1))
    switched = subprocess.run(run_cmd + ["--model", other], env=env, capture_output=True, text=True, timeout=480)
    assert switched.returncode == 0, switched.stderr[-4000:]
    assert f"{len(expected)} documents have results only from another model" in " ".join(switched.stderr.split()), \
        switched.stderr[-3000:]
    by_other = {(d.doc_id, d.image_index) for d in
                (Description.decode(r.value) for r in read_topic(topic_names, t.descriptions, timeout_s=30))
                if d.model == other}
    assert by_other == described
    latest = {}
    for record in read_topic(topic_names, t.results, timeout_s=30):
        result = DocumentResult.decode(record.value)
        latest[result.doc_id] = result
    assert {i.get("model") for r in latest.values() for i in r.images if i["status"] == "ok"} == {other}
    resumed = subprocess.run(run_cmd + ["--model", other], env=env, capture_output=True, text=True, timeout=480)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "another model" not in resumed.stderr and "published 0 documents" in " ".join(resumed.stderr.split())


def test_earlier_results_of_another_model_are_redone_once_all_earlier_results_are_read():
    """FoldedResults: a document whose earlier results all came from another model is to be redone, but only
    once the watcher has passed the results that were there when the run began (a result of the run's own model
    further down counts instead), and only once; results without a model (every image failed) count. A document
    the run sent waits for a result (and an answer) published after the run began."""
    from types import SimpleNamespace

    from vlmstream.cli.run_follow import FoldedResults, same_model

    def result(doc, *models):
        return SimpleNamespace(doc_id=doc, images=[{"status": "ok", "model": m} if m else {"status": "failed"}
                                                   for m in models])

    class Watcher:
        at = 0

        def position(self, tp):
            return self.at

    watcher, results = Watcher(), {}
    folded = FoldedResults({"results-0": 3}, "/models/mine")
    assert not folded.counts(result("a", "/models/theirs"), results, "results-0", 0)
    assert not folded.counts(result("b", "/models/theirs"), results, "results-0", 1)
    assert folded.counts(result("c", None), results, "results-0", 2)
    watcher.at = 2
    assert folded.to_redo(watcher) == {}  # not past the earlier results yet
    assert folded.counts(result("b", "/models/theirs", "/models/mine"), results, "results-0", 5)  # later, this model
    watcher.at = 3
    assert folded.to_redo(watcher) == {"a": "/models/theirs"}
    assert folded.to_redo(watcher) == {}
    assert not folded.counts(result("a", "/models/theirs"), results, "results-0", 6) and folded.to_redo(watcher) == {}
    assert same_model("/models/mine", "/models/mine") and not same_model("/models/mine", None)

    # A document the run published itself (new, or its content changed): only a result from after its start counts.
    folded = FoldedResults({"results-0": 3}, "/models/mine")
    folded.sent_now({"d"})
    assert not folded.counts(result("d", "/models/mine"), results, "results-0", 2)
    assert folded.counts(result("d", "/models/mine"), results, "results-0", 3)
    assert folded.counts(result("e", "/models/mine"), results, "results-0", 2)
    # and so do its answers (the summaries topic's partitions have ends of their own)
    folded.ends["summaries-0"] = 5
    assert not folded.current("d", "summaries-0", 4) and folded.current("d", "summaries-0", 5)
    assert folded.current("e", "summaries-0", 0)


def test_run_on_a_folder_without_images_says_so_before_starting_anything(tmp_path: Path):
    (tmp_path / "notes.txt").write_text("not an image")
    (tmp_path / ".hidden").mkdir()
    (tmp_path / ".hidden" / "a.jpg").write_bytes(b"skipped: hidden")
    env = {**os.environ, "VLMSTREAM_BOOTSTRAP_SERVERS": "127.0.0.1:1", "COLUMNS": "400"}  # nothing contacted
    done = subprocess.run([sys.executable, "-m", "vlmstream.cli", "run", str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "holds no image files" in " ".join(done.stderr.split())
    assert "workers started" not in done.stdout


@pytest.mark.model
def test_a_sigterm_while_a_finished_run_stops_its_workers_lets_them_drain_and_keeps_the_summary(
        kafka_settings: Settings, corpus_dir, tmp_path):
    """Every result in, the run stops its workers; a SIGTERM then (a supervisor's, say) is its first signal: the
    workers drain and exit 0, the summary is printed, and the exit status says the run was signalled."""
    folder = tmp_path / "docs"
    folder.mkdir()
    for path in sorted(p for p in corpus_dir.rglob("*") if p.suffix.lower() in (".jpg", ".png"))[:2]:
        shutil.copy(path, folder / path.name)
    env = dict(os.environ, VLMSTREAM_PRODUCER__STATE_DIR=str(tmp_path / "ledger"), OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "vlmstream.cli", "run", str(folder), "--per-file", "--fresh",
                             "--decode-workers", "1", "--max-pixels", str(128 * 28 * 28), "--max-new-tokens", "4",
                             "--show", "0", "--timeout-s", "400"],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("stopping:"):
                proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = " ".join("".join(lines).split())
    assert code == 143, said[-3000:]
    assert "workers stopped: {'decode': 0, 'infer': 0}" in said, said[-3000:]  # the summary, the workers drained
    assert "stopped by SIGTERM while its workers stopped: workers exited with decode 0, infer 0" in said

"""A folder of PDFs through `vlmstream run` (producer, decode, the tiny model, results): typed pages of mixed
sizes and rotations, scanned pages, an image beside them, and the hostile set in the same run. One description per
page, one result per document, each hostile file a dead letter naming its setting, nothing else lost."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from schemas import DeadLetter, Description, DocumentResult
from tests import pdfs
from tests.helpers import run_env
from tests.kafka_helpers import read_topic
from vlmstream.config import Settings

pytestmark = [pytest.mark.kafka, pytest.mark.model, pytest.mark.slow]

PAGE_LIMIT = 3


def _folder(root: Path) -> tuple[dict[str, int], dict[str, tuple[str, str]]]:
    """(doc_id -> pages to describe, hostile doc_id -> (error_kind, the setting its detail names))."""
    report = root / "report"
    report.mkdir(parents=True)
    Image.new("RGB", (300, 200), (20, 120, 200)).save(report / "01-cover.png")
    (report / "02-typed.pdf").write_bytes(pdfs.text_pdf([(612, 792, 0, "Letter"), (842, 595, 0, "A4 landscape"),
                                                         (612, 792, 90, "Turned")]))
    (report / "03-scanned.pdf").write_bytes(pdfs.scanned_pdf([(500, 650), (700, 400)]))
    (root / "script.pdf").write_bytes(pdfs.javascript_pdf())
    hostile = {}
    for name, (data, kind, words) in pdfs.hostile_set(PAGE_LIMIT).items():
        (root / f"{name}.pdf").write_bytes(data)
        hostile[f"{name}.pdf"] = (kind, words)
    return {"report": 6, "script.pdf": 1}, hostile


def test_a_folder_of_pdfs_runs_end_to_end(topic_names: Settings, tmp_path: Path, unique: str):
    folder = tmp_path / "pdfs"
    described, hostile = _folder(folder)
    t = topic_names.topics
    env = run_env(topic_names, tmp_path, f"pdf-{unique}", 3,
                  VLMSTREAM_DECODE__MAX_PDF_PAGES=str(PAGE_LIMIT), VLMSTREAM_DECODE__PDF_RENDER_TIME_LIMIT_S="2",
                  VLMSTREAM_DECODE__PDF_PAGE_TEXT_CHARS="40")
    proc = subprocess.run([sys.executable, "-m", "vlmstream.cli", "run", str(folder), "--decode-workers", "1",
                           "--max-pixels", str(128 * 28 * 28), "--max-new-tokens", "4", "--timeout-s", "400",
                           "--prompt", "Describe this page. Its text layer: {page_text}"],
                          env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stderr[-4000:]

    documents = {**described, **{doc: 1 for doc in hostile}}
    results = {}
    for record in read_topic(topic_names, t.results, expected=len(documents), timeout_s=60):
        result = DocumentResult.decode(record.value)  # schema-checked
        results[result.doc_id] = result
    assert set(results) == set(documents)
    for doc, pages in described.items():
        assert (results[doc].image_count, results[doc].succeeded, results[doc].failed) == (pages, pages, 0), \
            results[doc].images
    typed = str(folder / "report" / "02-typed.pdf")
    assert [image["source_uri"] for image in results["report"].images][1:4] == [
        f"{typed}#page={n}" for n in (1, 2, 3)]
    # Each typed page's text layer beside its description; the scans and the picture have none.
    assert [image.get("page_text") for image in results["report"].images] == [
        None, "Letter", "A4 landscape", "Turned", None, None]
    assert "page_text" not in results["report"].metadata

    descriptions = Counter()
    instruction_tokens = {}  # the prompt's tokens other than the image's, by page
    for record in read_topic(topic_names, t.descriptions, timeout_s=30):
        description = Description.decode(record.value)
        descriptions[(description.doc_id, description.image_index, description.source_uri)] += 1
        instruction_tokens[description.source_uri] = description.prompt_tokens - description.visual_tokens
    assert len(descriptions) == sum(described.values())  # one description per page, no hostile file described
    assert all(count == 1 for count in descriptions.values()), descriptions
    # {page_text} in the prompt: a typed page's instruction holds its text, a scan's has none to add.
    scanned = str(folder / "report" / "03-scanned.pdf")
    assert instruction_tokens[f"{typed}#page=2"] > instruction_tokens[f"{scanned}#page=1"], instruction_tokens
    assert instruction_tokens[f"{scanned}#page=1"] == instruction_tokens[f"{scanned}#page=2"]

    letters = {}
    for record in read_topic(topic_names, t.deadletter, timeout_s=30):
        letter = DeadLetter.decode(record.value)
        letters[letter.doc_id] = letter
    for doc, (kind, words) in hostile.items():
        assert (results[doc].image_count, results[doc].failed) == (1, 1)
        assert results[doc].images[0]["error_kind"] == kind, results[doc].images
        assert letters[doc].stage == "decode" and letters[doc].error_kind == kind and words in letters[doc].detail
    assert set(letters) == set(hostile), letters  # nothing else in the run was lost

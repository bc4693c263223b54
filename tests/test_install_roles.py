"""Installs by role: `pip install vlmstream` (no extra) runs the producer, the decode fleet and the tools without
torch, torchvision or transformers; the commands that run a model say which extra to add.

Two checks of the same promise. The quick ones run the code of this checkout in a subprocess where importing the
model engine's libraries fails, so a top-level `import torch` in a light module fails here in seconds. The slow one
installs the package, non-editable and without extras, into a fresh virtual environment and runs that environment's
`vlmstream produce` and `vlmstream decode` against the local broker.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from schemas import DocumentRef, decode_image_payload
from tests.helpers import SMALL, corpus_images
from tests.kafka_helpers import read_topic
from tests.test_layers import imports_of, project_modules
from vlmstream.extras import EXTRAS, install_command
from vlmstream.images.payload import payload_to_array

REPO = Path(__file__).resolve().parents[1]
ENGINE_MODULES = frozenset(module for modules in EXTRAS.values() for module in modules)
# What the base install runs: these packages are imported by the producer, decode and the tools.
LIGHT_PACKAGES = ("schemas", "producers", "consumers.decode", "vlmstream")
# The commands that run a model (vlmstream/cli/main.py wraps them in needs_model_engine), with the arguments they
# require (typer checks those first).
ENGINE_COMMANDS = {"infer": [], "condense": [], "tiny-model": ["{tmp}/tiny"], "run": ["{tmp}"], "estimate": ["{tmp}"]}

BLOCKER = f"""
import sys

class NoModelEngine:
    # Finds nothing for the model engine's packages, as on the base install (any later import of them fails).
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {sorted(ENGINE_MODULES)!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: the base install has none)", name=name)
        return None

sys.meta_path.insert(0, NoModelEngine())
"""


def run_without_model_engine(code: str, timeout_s: float = 120) -> dict:
    """Run ``code`` in a fresh interpreter on this checkout with the model engine's packages blocked; it prints
    one JSON line last, returned here."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-c", BLOCKER + code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_light_modules_import_without_the_model_engine():
    failed = run_without_model_engine(f"""
import importlib, json, pkgutil
failed = {{}}
names = ["vlmstream.cli.main"]  # the command's wiring imports every command module
for root in {LIGHT_PACKAGES!r}:
    package = importlib.import_module(root)
    names += [root] + [m.name for m in pkgutil.walk_packages(package.__path__, root + ".")
                       if not m.name.endswith("__main__")]
for name in names:
    try:
        importlib.import_module(name)
    except ImportError as exc:
        failed[name] = str(exc)
print(json.dumps(failed))
""")
    assert not failed, ("these modules of the base install import the model engine at import time (import it inside "
                        f"the function that uses it): {failed}")


def test_light_packages_never_import_the_model_engine_even_inside_functions():
    # The stages and floors the base install runs, function-local imports included: decode must never need torch.
    # (vlmstream.cli and the ground modules that start engines import it lazily, for the engine commands only.)
    modules = project_modules()
    light = [m for m in modules if m.split(".")[0] in ("schemas", "producers")
             or m.startswith(("consumers.decode", "vlmstream.images", "vlmstream.kafka", "vlmstream.models"))]
    assert "consumers.decode.stage" in light and "vlmstream.images.payload" in light
    found = [f"{modules[m].relative_to(REPO)}:{line} imports {target}" for m in light
             for line, target in imports_of(m, modules[m]) if target.partition(".")[0] in ENGINE_MODULES]
    assert not found, found


def test_decode_and_help_work_and_engine_commands_name_the_extra_without_the_model_engine(corpus_dir, tmp_path):
    images = [str(p) for p in corpus_images(corpus_dir, 2)]
    out = run_without_model_engine(f"""
import json
from typer.testing import CliRunner
from consumers.decode.stage import DecodeStage
from vlmstream.cli.main import app
from vlmstream.config import DecodeSettings

stage = DecodeStage(DecodeSettings(max_pixels={SMALL}, allowed_roots=[{str(corpus_dir)!r}], codec="jpeg"))
decoded = [[p.width, p.height] if hasattr(p, "width") else [p.error_kind, p.detail]
           for p in map(stage, {images!r})]
stage.close()
runner = CliRunner()
calls = {{"--help": ["--help"], "decode --help": ["decode", "--help"], "infer --help": ["infer", "--help"]}}
calls.update({{command: [command, *(a.format(tmp={str(tmp_path)!r}) for a in arguments)]
              for command, arguments in {ENGINE_COMMANDS!r}.items()}})
answers = {{}}
for name, args in calls.items():
    result = runner.invoke(app, ["--bootstrap-servers", "127.0.0.1:1", *args])
    answers[name] = [result.exit_code, result.output]
print(json.dumps({{"decoded": decoded, "answers": answers}}))
""")
    for width, height in out["decoded"]:
        assert isinstance(width, int) and width % 28 == 0 and height % 28 == 0, out["decoded"]
    answers = out["answers"]
    for help_of in ("--help", "decode --help", "infer --help"):
        assert answers[help_of][0] == 0, answers[help_of]
    for command in ENGINE_COMMANDS:
        code, said = answers[command]
        assert code == 2, (command, code, said)
        assert f"vlmstream {command} runs a model" in said and install_command("cpu") in said, said
        assert "Traceback" not in said, said


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_the_base_install_produces_and_decodes_without_torch(topic_names, corpus_dir, tmp_path, unique):
    # A clean copy (as tests/test_packaging.py makes): a checkout's build/ folder could hide what the install lacks.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "constraints.txt"):
        shutil.copy2(REPO / name, source / name)
    for root in ("vlmstream", "producers", "consumers", "schemas"):
        shutil.copytree(REPO / root, source / root, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    # Nothing of this checkout or the test's own environment may leak into the installed one.
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV") and not k.startswith("VLMSTREAM_")}
    env.update({"VLMSTREAM_HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"})
    venv = tmp_path / "venv"
    started = time.monotonic()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=env, timeout=120)
    python = venv / "bin" / "python"
    installed = subprocess.run([str(python), "-m", "pip", "install", "-q", "-c", str(source / "constraints.txt"),
                                str(source)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    install_s = time.monotonic() - started
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    print(f"fresh venv and base install: {install_s:.0f} s")

    listed = subprocess.run([str(python), "-c", "import importlib.metadata as m, json, vlmstream; print(json.dumps("
                             "[vlmstream.__file__, sorted(d.metadata['Name'].lower() for d in m.distributions())]))"],
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=True)
    where, distributions = json.loads(listed.stdout)
    assert Path(where).is_relative_to(venv), where  # the installed package, not this checkout
    assert "vlmstream" in distributions and "kafka-python" in distributions
    heavy = sorted(ENGINE_MODULES.intersection(distributions) | {d for d in distributions if d.startswith("nvidia-")})
    assert not heavy, f"the base install pulled the model engine: {heavy}"

    folder = tmp_path / "scans"
    folder.mkdir()
    for n, path in enumerate(corpus_images(corpus_dir, 3)):
        shutil.copy2(path, folder / f"page{n}{path.suffix.lower()}")
    config = tmp_path / "base-install.json"
    config.write_text(json.dumps({
        "kafka": {"bootstrap_servers": topic_names.kafka.bootstrap_servers},
        "topics": topic_names.topics.model_dump(mode="json"),
        "producer": {"state_dir": str(tmp_path / "ledger")},
        "decode": {"group_id": f"decode-{unique}", "session_timeout_ms": 6000, "allowed_roots": [str(folder)],
                   "max_pixels": SMALL},
    }))
    vlmstream = [str(venv / "bin" / "vlmstream"), "--config", str(config)]

    produced = subprocess.run([*vlmstream, "produce", "--folder", str(folder), "--per-file", "--quiet"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert produced.returncode == 0, produced.stdout[-3000:] + produced.stderr[-3000:]
    documents = [DocumentRef.decode(r.value) for r in
                 read_topic(topic_names, topic_names.topics.documents, expected=3, timeout_s=30, idle_s=1)]
    assert len(documents) == 3 and all(len(d.image_uris) == 1 for d in documents), documents

    decoded = subprocess.run([*vlmstream, "decode", "--workers", "1", "--until-idle-s", "3"],
                             cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert decoded.returncode == 0, decoded.stdout[-3000:] + decoded.stderr[-3000:]
    images = read_topic(topic_names, topic_names.topics.images, expected=3, timeout_s=30, idle_s=1)
    assert sorted(r.key.decode() for r in images) == sorted(f"{d.doc_id}/0" for d in documents)
    for record in images:
        payload = decode_image_payload(record.headers)
        assert Path(payload.source_uri).parent == folder
        assert payload.width % 28 == 0 and payload.height % 28 == 0 and payload.width * payload.height <= SMALL
        pixels = payload_to_array(payload, record.value)
        assert pixels.shape == (payload.height, payload.width, 3)
        assert pixels.std() > 1.0  # the picture, not a blank frame
    assert read_topic(topic_names, topic_names.topics.deadletter, timeout_s=5, idle_s=1) == []

    refused = subprocess.run([*vlmstream, "infer"], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=60)
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert install_command("cpu") in refused.stderr and "Traceback" not in refused.stderr, refused.stderr

"""The installed package holds all of the code: a non-editable install (what the Docker images do) gets only what
the wheel lists, and a fixed package list once left out consumers.decode and consumers.infer."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOTS = ("vlmstream", "producers", "consumers", "schemas")


@pytest.mark.slow
def test_the_wheel_holds_every_package_and_its_data(tmp_path):
    # From a clean copy: setuptools reuses a checkout's build/ folder, whose files from earlier builds would hide a
    # package the configuration leaves out.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for root in ROOTS:
        shutil.copytree(REPO / root, source / root, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(source)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = tmp_path.glob("vlmstream-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {str(init.parent.relative_to(REPO))
                for root in ROOTS
                for init in (REPO / root).rglob("__init__.py")}
    assert {"consumers/decode", "consumers/infer", "consumers/infer/vision", "vlmstream/kafka"} <= packages
    missing = sorted(p for p in packages if f"{p}/__init__.py" not in names)
    assert not missing, f"packages left out of the wheel: {missing}"
    modules = {str(m.relative_to(REPO)) for p in packages for m in (REPO / p).glob("*.py")}
    assert not sorted(modules - names), sorted(modules - names)
    data = {"vlmstream/kafka/log4j2.xml", "vlmstream/kafka/pom.xml",
            *(str(s.relative_to(REPO)) for s in (REPO / "schemas" / "json").glob("*.schema.json"))}
    assert data <= names, sorted(data - names)


def test_no_installed_module_imports_the_benchmarks():
    """Benchmark code (the GPU models' configs, the arms) lives under benchmarks/, which the wheel does not hold: an
    installed module that imported it would fail on every install but a checkout."""
    importers = sorted(str(path.relative_to(REPO)) for root in ROOTS for path in (REPO / root).rglob("*.py")
                       if any(line.lstrip().startswith(("from benchmarks", "import benchmarks"))
                              for line in path.read_text().splitlines()))
    assert not importers, importers

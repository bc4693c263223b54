"""The user documents stay true to the code: docs/configuration.md is what the generator makes from the settings
classes now, and every file the README and docs/ point at exists."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from pydantic import Field

import vlmstream.config
from vlmstream.config import DecodeSettings, Settings

ROOT = Path(__file__).resolve().parent.parent
CONFIG_PAGE = ROOT / "docs" / "configuration.md"
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "scripts" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_page_is_what_the_generator_makes_now():
    assert CONFIG_PAGE.read_text() == _generator().render(), (
        "docs/configuration.md is out of date with vlmstream/config.py: run python scripts/gen_config_reference.py")


def test_every_setting_has_its_row_and_environment_variable():
    page = CONFIG_PAGE.read_text()
    for section, field in Settings.model_fields.items():
        annotation = field.annotation
        names = (
            [f"{section}.{name}" for name in annotation.model_fields]
            if isinstance(annotation, type) and hasattr(annotation, "model_fields") else [section]
        )
        for key in names:
            env = "VLMSTREAM_" + "__".join(key.upper().split("."))
            assert f"| `{key}` | `{env}` |" in page, f"{key} is missing from docs/configuration.md"


def test_a_changed_setting_changes_the_page(monkeypatch):
    """The generator reads the classes: a new field (and a changed default) shows up, so the first test fails when a
    setting changes without the page being regenerated."""

    class ChangedDecode(DecodeSettings):
        brand_new_knob: int = Field(7, description="A setting the page does not have yet.")

    class ChangedSettings(Settings):
        decode: ChangedDecode = Field(default_factory=ChangedDecode)

    before = _generator().render()
    monkeypatch.setattr(vlmstream.config, "Settings", ChangedSettings)
    after = _generator().render()
    assert after != before
    assert "| `decode.brand_new_knob` | `VLMSTREAM_DECODE__BRAND_NEW_KNOB` | int | `7` | A setting the page" in after


LINK = re.compile(r"\]\(([^)\s]+)\)")
CODE_PATH = re.compile(r"`([A-Za-z0-9_.-]+(?:/[A-Za-z0-9_.-]+)+\.(?:py|sh|md|json|ya?ml|toml|txt|png|xml))`")


def _targets(doc: Path) -> list[tuple[str, Path]]:
    text = doc.read_text()
    found = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        found.append((target, (doc.parent / target.split("#")[0]).resolve()))
    for mention in CODE_PATH.findall(text):
        found.append((mention, (ROOT / mention).resolve()))
    return found


@pytest.mark.parametrize("doc", USER_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_linked_or_named_file_exists(doc):
    missing = [name for name, path in _targets(doc) if not path.exists()]
    assert not missing, f"{doc.relative_to(ROOT)} points at files that do not exist: {missing}"


def test_the_link_check_sees_a_missing_file(tmp_path):
    doc = tmp_path / "page.md"
    doc.write_text("See [gone](gone.md) and `vlmstream/no_such_module.py`; [web](https://example.org) is skipped.")
    names = [name for name, path in _targets(doc) if not path.exists()]
    assert names == ["gone.md", "vlmstream/no_such_module.py"]


def test_topics_page_names_every_field_of_every_message_schema():
    """docs/topics.md's message table lists each schema file's properties, so a schema change shows up there."""
    import json

    page = (ROOT / "docs" / "topics.md").read_text()
    rows = {line.split("`")[3]: line for line in page.splitlines() if line.startswith("| `") and ".schema.json" in line}
    for schema_file in sorted((ROOT / "schemas" / "json").glob("*.schema.json")):
        assert schema_file.name in rows, f"docs/topics.md has no row for {schema_file.name}"
        schema = json.loads(schema_file.read_text())
        missing = [name for name in schema["properties"] if f"`{name}`" not in rows[schema_file.name]]
        assert not missing, f"docs/topics.md's {schema_file.name} row lacks {missing}"
        required = [name for name in schema.get("required", []) if f"**`{name}`**" not in rows[schema_file.name]]
        assert not required, f"docs/topics.md's {schema_file.name} row does not mark {required} as required"

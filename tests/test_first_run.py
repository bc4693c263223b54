"""What a newcomer meets first: the refused-path dead letter names the setting to change, and `vlmstream run`
says what earlier runs left queued ahead of its documents."""

from __future__ import annotations

import re

import pytest

from consumers.decode.fetch import Fetcher
from vlmstream.config import load_settings
from vlmstream.images.errors import ImageError


def test_a_refused_path_names_the_setting_the_path_and_the_roots_in_force(tmp_path, monkeypatch):
    root = tmp_path / "root"
    root.mkdir()
    outside = tmp_path / "elsewhere" / "photo.jpg"
    outside.parent.mkdir()
    outside.write_bytes(b"\xff\xd8\xff")
    with pytest.raises(ImageError) as info:
        Fetcher(allowed_roots=[str(root)]).fetch(str(outside))
    assert info.value.error_kind == "fetch_forbidden_path"
    detail = str(info.value)
    assert str(outside) in detail and str(root) in detail
    assert "decode.allowed_roots" in detail and "VLMSTREAM_DECODE__ALLOWED_ROOTS" in detail

    # The default root (the current directory) is the one shown when none is set.
    monkeypatch.chdir(root)
    with pytest.raises(ImageError) as info:
        Fetcher().fetch(str(outside))
    assert f"({root.resolve()})" in str(info.value)

    # What the message tells the user to set works as written.
    value = re.search(r"VLMSTREAM_DECODE__ALLOWED_ROOTS='([^']*)'", detail).group(1)
    monkeypatch.setenv("VLMSTREAM_DECODE__ALLOWED_ROOTS", value)
    assert load_settings().decode.allowed_roots == ["/data/images"]

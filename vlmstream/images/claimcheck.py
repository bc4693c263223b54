"""Claim-check store: payloads too large for a Kafka record are written here and the record carries the reference.

Names are content addresses inside a per-record folder, ``<root>/<quoted key>/<sha256>.bin``: a redelivered record
writes the same name (no duplicate object), and two documents that happen to share an image never share an
object, so deleting one document's payload cannot break the other.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path
from urllib.parse import quote, urlsplit

from vlmstream.images.errors import ImageError


class ClaimCheckError(ImageError):
    error_kind = "claim_check_error"


class ClaimCheckStore:
    """A local folder (a plain path or ``file://``) or any fsspec URL (``s3://bucket/prefix``, ``memory://x``)."""

    def __init__(self, url: str):
        if not url:
            raise ValueError("claim-check store needs a folder or fsspec URL")
        scheme = urlsplit(url).scheme
        self.url = url
        if scheme in ("", "file") or len(scheme) == 1:  # one letter: a Windows drive, not a scheme
            path = urlsplit(url).path if scheme == "file" else url
            self._root = Path(path).expanduser().resolve()
            self._fs = None
        else:
            import fsspec

            self._fs, root = fsspec.core.url_to_fs(url)
            self._root = root.rstrip("/")
            self._protocol = scheme

    def put(self, key: str, data: bytes) -> str:
        """Write ``data`` (idempotent for the same key and content) and return the reference to put in the record."""
        name = f"{quote(key, safe='')}/{hashlib.sha256(data).hexdigest()}.bin"
        if self._fs is None:
            target = self._root / name
            if target.exists() and target.stat().st_size == len(data):
                return str(target)
            target.parent.mkdir(parents=True, exist_ok=True)
            # Write-then-rename: a reader never sees half an object, and a crash leaves only a temp file.
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, target)
            return str(target)
        path = f"{self._root}/{name}"
        if not self._fs.exists(path):
            self._fs.pipe_file(path, data)
        return self._fs.unstrip_protocol(path)

    def get(self, ref: str) -> bytes:
        if self._fs is None:
            return self._local_path(ref).read_bytes()
        return self._fs.cat_file(self._remote_path(ref))

    def delete(self, ref: str) -> None:
        if self._fs is None:
            path = self._local_path(ref)
            path.unlink(missing_ok=True)
            try:
                path.parent.rmdir()
            except OSError:
                pass  # other objects still in the folder
            return
        path = self._remote_path(ref)
        if self._fs.exists(path):
            self._fs.rm_file(path)

    # A reference arrives in a record header, i.e. from the network: never follow it outside the store.
    def _local_path(self, ref: str) -> Path:
        raw = urlsplit(ref).path if ref.startswith("file://") else ref
        path = Path(raw).resolve()
        if not path.is_relative_to(self._root):
            raise ClaimCheckError(f"reference {ref!r} is outside the claim-check store {self._root}")
        return path

    def _remote_path(self, ref: str) -> str:
        path = self._fs._strip_protocol(ref)
        if not path.startswith(self._root + "/") or ".." in path.split("/"):
            raise ClaimCheckError(f"reference {ref!r} is outside the claim-check store {self.url}")
        return path


def claim_check_url(settings) -> str:
    """Where oversized payloads go (decode) and are read back (inference): one rule, so both sides agree.
    ``settings`` is the whole vlmstream Settings."""
    return settings.decode.claim_check_url or str(settings.broker.home / "claim-check")

"""Sources that follow input as it grows: a folder (a document goes out once its files have settled) and a
JSON-lines manifest (``tail -f``). Both poll, yield IDLE between looks, and stop on ``stop`` or a deadline."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import IO, Iterator

from producers.folder import DEFAULT_MAX_PDF_PAGES, folder_document, folder_groups
from producers.items import IDLE, SourceItem, replace_non_utf8
from producers.json_document import parse_json_line


def _stop_requested(stop: threading.Event | None, deadline: float | None, wait_s: float) -> bool:
    if deadline is not None:
        wait_s = min(wait_s, max(0.0, deadline - time.monotonic()))
    stopped = stop.wait(wait_s) if stop is not None else (time.sleep(wait_s) or False)
    return stopped or (deadline is not None and time.monotonic() >= deadline)


def _stat_or_link(path: Path) -> os.stat_result:
    """A link whose target is gone still names an image of the document: the decode stage dead-letters it as
    missing, as when a folder is scanned once. Only a path gone altogether (moved away) raises."""
    try:
        return path.stat()
    except FileNotFoundError:
        return path.lstat()


def watch_folder(root: str | Path, *, per_file: bool = False, settle_s: float = 2.0, poll_s: float = 0.5,
                 stop: threading.Event | None = None, max_seconds: float | None = None,
                 max_pdf_pages: int = DEFAULT_MAX_PDF_PAGES) -> Iterator[SourceItem]:
    """Follow a folder by polling: a document is published once its files (names, sizes, mtimes) have
    stayed unchanged for ``settle_s``, so a subfolder still being copied is not sent half-full.
    Documents already there at start whose newest file is older than ``settle_s`` go out at once.
    A document that changes later is yielded again (the ledger decides whether its content changed).
    """
    root = Path(root).absolute()
    deadline = time.monotonic() + max_seconds if max_seconds is not None else None
    yielded: dict[str, tuple] = {}
    changing: dict[str, tuple[tuple, float]] = {}  # doc_id -> (signature, first seen with it)
    first_scan = True
    while True:
        now_mono, now_wall = time.monotonic(), time.time()
        groups = folder_groups(root, per_file=per_file) if root.is_dir() else {}  # may appear later
        for doc_id, files in groups.items():
            if isinstance(files, OSError):  # a folder that cannot be listed: said once, again if the error changes
                signature: tuple = ("unreadable", str(files))
                if yielded.get(doc_id) != signature:
                    yielded[doc_id] = signature
                    yield folder_document(root, doc_id, files, max_pdf_pages)
                continue
            try:
                stats = [_stat_or_link(p) for p in files]
            except FileNotFoundError:
                continue  # moved away while we looked: the next scan sees the new state
            signature = tuple((str(p), s.st_size, s.st_mtime_ns) for p, s in zip(files, stats))
            if yielded.get(doc_id) == signature:
                continue
            seen = changing.get(doc_id)
            if seen is None or seen[0] != signature:
                changing[doc_id] = (signature, now_mono)
                newest = max(s.st_mtime for s in stats)
                if not (first_scan and now_wall - newest >= settle_s):
                    continue
            elif now_mono - seen[1] < settle_s:
                continue
            changing.pop(doc_id, None)
            yielded[doc_id] = signature
            yield folder_document(root, doc_id, files, max_pdf_pages)
        first_scan = False
        yield IDLE
        if _stop_requested(stop, deadline, poll_s):
            return


def follow_jsonl(path: str | Path, *, poll_s: float = 0.5, stop: threading.Event | None = None,
                 max_seconds: float | None = None) -> Iterator[SourceItem]:
    """``tail -f`` for a JSONL manifest: existing lines first, then each new complete line (a line
    still being written, without its newline, waits). A truncated or replaced file is read again
    from its start; the ledger keeps that from publishing documents twice.
    """
    path = Path(path).absolute()
    if path.suffix.lower() in (".csv", ".tsv", ".json", ".gz"):
        raise ValueError("watching follows uncompressed JSON-lines manifests; a CSV document's rows cannot be known "
                         "complete, a .json list is one value, and a gzip stream is not read as it grows")
    base_dir, origin = str(path.parent), replace_non_utf8(path)
    deadline = time.monotonic() + max_seconds if max_seconds is not None else None
    fh: IO[bytes] | None = None
    inode = None
    line_no, pending = 0, b""
    try:
        while True:
            try:
                st = path.stat()
            except FileNotFoundError:
                st = None
            if st is not None and (fh is None or st.st_ino != inode or st.st_size < fh.tell()):
                if fh is not None:
                    fh.close()
                fh, inode, line_no, pending = open(path, "rb"), st.st_ino, 0, b""
            if fh is not None:
                while chunk := fh.read(1 << 20):
                    lines = (pending + chunk).split(b"\n")
                    pending = lines.pop()
                    for raw in lines:
                        line_no += 1
                        raw = raw.rstrip(b"\r")
                        if raw.strip():
                            yield parse_json_line(raw, line=line_no, origin=origin, base_dir=base_dir)
            yield IDLE
            if _stop_requested(stop, deadline, poll_s):
                return
    finally:
        if fh is not None:
            fh.close()

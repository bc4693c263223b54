"""Documents from a byte stream such as stdin: a JSON object per line, or a bare path or URI (one image, one
document, id = the text)."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import IO, Iterator

import orjson

from producers.items import BOM, IDLE, Rejection, SourceItem, resolve_uri, validated
from producers.json_document import parse_json_line
from schemas import DocumentRef, SchemaError


def parse_stdin_line(raw: bytes, *, line: int, base_dir: str | Path, origin: str = "stdin") -> DocumentRef | Rejection:
    """A JSON object like a manifest line, or a bare path/URI: one image, one document, id = the text."""
    text = raw.strip().removeprefix(BOM)
    if text.startswith(b"{"):
        return parse_json_line(text, line=line, origin=origin, base_dir=base_dir)
    if text.startswith(b"["):
        try:
            orjson.loads(text)
        except orjson.JSONDecodeError:
            pass  # a path that starts with '[': "[scan] page 1.jpg"
        else:
            return Rejection(origin, line, "not_an_object", "a JSON array: give one document object per line, or a "
                             "bare path", raw)
    try:
        uri = text.decode()
    except UnicodeDecodeError as exc:
        return Rejection(origin, line, "invalid_utf8", str(exc), raw)
    try:
        return validated(DocumentRef(doc_id=uri, image_uris=(resolve_uri(uri, base_dir),),
                                     source=f"{origin}:{line}"))
    except SchemaError as exc:
        return Rejection(origin, line, "schema_violation", str(exc), raw, uri)


def read_lines(stream: IO[bytes], *, base_dir: Path | None = None, idle_s: float = 1.0,
               stop: threading.Event | None = None) -> Iterator[SourceItem]:
    """Lines of a (possibly never-ending) byte stream such as stdin.

    A reader thread feeds a queue so the publisher hears IDLE while the stream is quiet and can
    settle acknowledgements (and notice ``stop``) instead of blocking inside readline.
    """
    base_dir = base_dir or Path.cwd()
    lines: queue.Queue[bytes | None] = queue.Queue(maxsize=10_000)

    def pump() -> None:
        try:
            for raw in stream:
                lines.put(raw)
        finally:
            lines.put(None)

    threading.Thread(target=pump, name="vlmstream-stdin", daemon=True).start()
    line_no = 0
    quiet_for = 0.05  # a short pause ends a burst: the lines so far go out without waiting for more
    while not (stop and stop.is_set()):
        try:
            raw = lines.get(timeout=quiet_for)
        except queue.Empty:
            yield IDLE
            quiet_for = idle_s
            continue
        quiet_for = 0.05
        if raw is None:
            return
        line_no += 1
        if raw.strip():
            yield parse_stdin_line(raw.rstrip(b"\r\n"), line=line_no, base_dir=base_dir)

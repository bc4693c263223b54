"""What this machine has already published, so re-running a manifest sends nothing twice.

One sqlite file (stdlib, no server). A row is keyed by (topic, bootstrap servers, record id) and holds
a content hash: a document whose content changed is published again, an identical one is skipped.
Rows are written only after the broker acknowledged the send, in batches inside one transaction;
a crash between acknowledgement and write means the document goes out again on the next run
(at least once, never lost).
"""

from __future__ import annotations

import hashlib
import sqlite3
import time
from pathlib import Path
from typing import Iterable

import orjson

from schemas import DocumentRef
from vlmstream.config import Settings

LEDGER_FILE = "ledger.sqlite3"


def ledger_path(settings: Settings) -> Path:
    folder = settings.producer.state_dir or (settings.broker.home / "producer-ledger")
    return Path(folder) / LEDGER_FILE


def bootstrap_scope(settings: Settings) -> str:
    """The same cluster named in another order is the same cluster."""
    return ",".join(sorted(s.strip() for s in settings.kafka.bootstrap_servers.split(",") if s.strip()))


def document_hash(doc: DocumentRef) -> str:
    """Hash of what the document is: id, images, metadata. Not published_at (changes every send) and not
    source (a manifest line moving down one line must not republish the document)."""
    body = orjson.dumps({"doc_id": doc.doc_id, "image_uris": list(doc.image_uris), "metadata": doc.metadata},
                        option=orjson.OPT_SORT_KEYS)
    return hashlib.blake2b(body, digest_size=16).hexdigest()


def bytes_hash(*parts: bytes) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()


class Ledger:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit mode; batches open their own transaction. Two producers may share the file:
        # WAL lets readers run beside a writer and busy_timeout waits out the other's write.
        self._db = sqlite3.connect(self.path, isolation_level=None, timeout=30.0)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute(
            "CREATE TABLE IF NOT EXISTS published ("
            " topic TEXT NOT NULL, bootstrap TEXT NOT NULL, record_id TEXT NOT NULL,"
            " content_hash TEXT NOT NULL, published_at REAL NOT NULL,"
            " PRIMARY KEY (topic, bootstrap, record_id)) WITHOUT ROWID"
        )

    def content_hash(self, topic: str, bootstrap: str, record_id: str) -> str | None:
        row = self._db.execute(
            "SELECT content_hash FROM published WHERE topic=? AND bootstrap=? AND record_id=?",
            (topic, bootstrap, record_id),
        ).fetchone()
        return row[0] if row else None

    def content_hashes(self, topic: str, bootstrap: str, record_ids: list[str]) -> dict[str, str]:
        """Many lookups in few statements: each statement releases the GIL, and getting it back from a
        busy Kafka sender thread can cost milliseconds, so one query per document would dominate."""
        found: dict[str, str] = {}
        for start in range(0, len(record_ids), 900):
            part = record_ids[start:start + 900]
            marks = ",".join("?" * len(part))
            found.update(self._db.execute(
                f"SELECT record_id, content_hash FROM published WHERE topic=? AND bootstrap=? AND record_id IN ({marks})",
                (topic, bootstrap, *part),
            ).fetchall())
        return found

    def record(self, rows: Iterable[tuple[str, str, str, str]]) -> int:
        """rows: (topic, bootstrap, record_id, content_hash), all in one transaction."""
        stamp = time.time()
        rows = [(*row, stamp) for row in rows]
        if not rows:
            return 0
        self._db.execute("BEGIN IMMEDIATE")
        try:
            self._db.executemany(
                "INSERT INTO published (topic, bootstrap, record_id, content_hash, published_at)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT (topic, bootstrap, record_id)"
                " DO UPDATE SET content_hash=excluded.content_hash, published_at=excluded.published_at",
                rows,
            )
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")
        return len(rows)

    def count(self, topic: str, bootstrap: str) -> int:
        return self._db.execute("SELECT count(*) FROM published WHERE topic=? AND bootstrap=?",
                                (topic, bootstrap)).fetchone()[0]

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> "Ledger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

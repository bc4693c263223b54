"""`vlmstream view`: the command; the page, its state and its Kafka reader are in vlmstream/cli/view_page.py
(imported when the command runs, so that `vlmstream --help` does not load a web framework)."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer


def view(
    ctx: typer.Context,
    host: Optional[str] = typer.Option(None, "--host", help="Address to listen on (view.host, default 127.0.0.1: "
                                       "this machine only)."),
    port: Optional[int] = typer.Option(None, "--port", help="Port (view.port, default 8765)."),
    root: List[Path] = typer.Option([], "--root", help="A folder whose images the page may show, besides "
                                    "decode.allowed_roots (repeatable; `vlmstream run FOLDER` reads FOLDER)."),
) -> None:
    """A local web page following the output topics live: thumbnails beside their descriptions, document results,
    summaries and dead letters, filters, and the pipeline's progress. Ctrl-C stops it."""
    from rich.console import Console

    from vlmstream.cli.support import bootstrap, settings_from
    from vlmstream.cli.view_page import serve
    from vlmstream.images.localfiles import LocalFiles

    settings = bootstrap(settings_from(ctx, {"view": {"host": host, "port": port}}))
    roots = list(settings.decode.allowed_roots) + [str(r.resolve()) for r in root]
    settings = settings.model_copy(update={"decode": settings.decode.model_copy(update={"allowed_roots": roots})})
    where = ", ".join(str(r) for r in LocalFiles(roots).roots)
    Console(stderr=True).print(f"vlmstream view: http://{settings.view.host}:{settings.view.port}/ (images from "
                               f"{where}; Ctrl-C stops it)")
    serve(settings, settings.view.host, settings.view.port)

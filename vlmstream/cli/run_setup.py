"""What `vlmstream run` settles before anything starts: the documents of its folder or manifest, and the settings its
workers get (the pixel budget, the model and its family, the folders decode may read, --fresh's own topics); and
what `vlmstream estimate` settles the same way."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from vlmstream.models import qwen2_vl

console = Console(stderr=True)
# The built-in tiny model's text is meaningless at any size, and its CPU time grows with the pixels: at the
# checkpoint's 12.8 MP a folder of large photos takes minutes on two cores, at 0.4 MP about half a minute
# (benchmarks/first_run.py measures it). 0.4 MP leaves room for a busier machine; --max-pixels or decode.max_pixels
# change it.
TINY_MODEL_MAX_PIXELS = 512 * qwen2_vl.FACTOR**2  # 401,408


@dataclass
class RunSource:
    """A run's documents (DocumentRefs, and rejections of a manifest's bad lines) and the folders their local
    images lie in."""
    path: Path
    items: list[Any]
    image_roots: list[str]


def read_source(folder: Path | None, *, per_file: bool, id_prefix: str, decode: Any) -> RunSource:
    """The documents of a folder (a subfolder per document, or one per file) or a manifest, read before anything
    starts: an empty or mistyped folder needs no broker, model or workers to say so. A PDF is a document of its
    pages (at most decode.max_pdf_pages); a manifest's remote PDF is fetched with the decode stage's rules
    (``decode``: its settings) to count them."""
    from producers.folder import IMAGE_EXTENSIONS, scan_folder, skipped_files_line
    from producers.items import with_id_prefix, with_pdf_pages
    from schemas import DocumentRef

    if folder is None:
        from vlmstream.cli.samples import sample_folder

        folder = sample_folder()
        console.print(f"[dim]no folder given: using the built-in sample images in {folder}[/]")
    folder = folder.resolve()
    if folder.is_file():  # a manifest: its documents as they are
        from producers.manifest import read_manifest

        from vlmstream.images.fetch import Fetcher

        fetcher = Fetcher.from_settings(decode)
        try:
            items = list(with_pdf_pages(read_manifest(folder), decode.max_pdf_pages, fetcher.fetch))
        finally:
            fetcher.close()
        image_roots = manifest_roots(items)
        if not any(isinstance(item, DocumentRef) for item in items):
            raise typer.BadParameter(f"{folder} holds no valid document (see the rejections: vlmstream produce "
                                     f"--manifest {folder} lists them)")
    elif not folder.is_dir():
        raise typer.BadParameter(f"{folder} is not a folder or a manifest file")
    else:
        skipped: list[Path] = []
        items = list(scan_folder(folder, per_file=per_file, skipped=skipped,
                                 max_pdf_pages=decode.max_pdf_pages))
        image_roots = [str(folder)]
        if skipped:
            console.print(f"[yellow]{escape(skipped_files_line(skipped, folder))}[/]")
    items = list(with_id_prefix(items, id_prefix))
    if not items:
        extensions = " ".join(sorted(IMAGE_EXTENSIONS))
        raise typer.BadParameter(f"{folder} holds no image files (looked for {extensions}, in it and its "
                                 "subfolders; hidden ones are skipped)")
    return RunSource(folder, items, image_roots)


def manifest_roots(items: list[Any]) -> list[str]:
    """The folders a manifest's local images lie in: `vlmstream run MANIFEST` lets its decode workers read there."""
    from schemas import DocumentRef

    roots: set[str] = set()
    for item in items:
        if isinstance(item, DocumentRef):
            for uri in item.image_uris:
                path = uri.removeprefix("file://").split("#", 1)[0]
                if "://" not in path:
                    roots.add(str(Path(path).resolve().parent))
    return sorted(roots)


def with_allowed_roots(settings: Any, roots: list[str]) -> Any:
    """decode.allowed_roots and ``roots`` (the folders the run's own images lie in)."""
    allowed = list(settings.decode.allowed_roots)
    allowed += [root for root in roots if root not in allowed]
    return settings.model_copy(update={"decode": settings.decode.model_copy(update={"allowed_roots": allowed})})


def with_model(settings: Any) -> Any:
    """infer.model, else the built-in tiny random-weight model (said on the console)."""
    if settings.infer.model:
        return settings
    from consumers.infer.tiny_model import default_tiny_model_dir

    tiny = default_tiny_model_dir()
    console.print(f"[yellow]no --model: using the built-in tiny random-weight Qwen2.5-VL ({tiny}); "
                  "its descriptions are meaningless text. Pass --model for real ones.[/]")
    return settings.model_copy(update={"infer": settings.infer.model_copy(update={"model": str(tiny)})})


def with_model_family(settings: Any) -> tuple[Any, str]:
    """Decode resizes for the model that infers: a local checkpoint folder (infer.model) becomes decode.model unless
    that is set, so its config.json picks the family and its image processor settings bound the pixels. Fails here,
    before anything starts, when no family describes the checkpoint. Returns the settings and the line saying which."""
    from consumers.decode.stage import decode_family

    model = settings.infer.model
    if not settings.decode.model and model and (Path(model) / "config.json").is_file():
        settings = settings.model_copy(update={"decode": settings.decode.model_copy(update={"model": model})})
    family = decode_family(settings.decode)
    source = f"from {settings.decode.model}" if settings.decode.model else "decode.model_family"
    if not family.exact_size:
        # The generic path has no tower of ours to make image_embeds: vLLM runs the model's own (pixels mode).
        if settings.infer.mode == "embeds" and "mode" not in settings.infer.model_fields_set:
            settings = settings.model_copy(update={"infer": settings.infer.model_copy(update={"mode": "pixels"})})
        return settings, (f"model family: generic ({source}): the model's own processor; images decoded, oriented "
                          f"and capped at what it keeps (at most {family.max_pixels:,} px); infer.mode=pixels, "
                          "no embeddings")
    return settings, (f"model family: {family.name} ({source}): {family.factor} px blocks, "
                      f"{family.min_pixels:,} to {family.max_pixels:,} px per image")


def with_pixel_budget(settings: Any) -> tuple[Any, str]:
    """The built-in tiny model (no infer.model) gets TINY_MODEL_MAX_PIXELS unless decode.max_pixels was given (flag,
    file or environment); a real model keeps the configured budget. Returns the settings and the line saying which."""
    if not settings.infer.model and "max_pixels" not in settings.decode.model_fields_set:
        settings = settings.model_copy(update={"decode": settings.decode.model_copy(
            update={"max_pixels": TINY_MODEL_MAX_PIXELS})})
        return settings, (f"pixel budget: {TINY_MODEL_MAX_PIXELS:,} px per image ({TINY_MODEL_MAX_PIXELS / 1e6:.1f} MP, "
                          "the built-in tiny model's CPU default: about a minute for 25 large photos on 2 cores); "
                          "--max-pixels N or decode.max_pixels changes it")
    return settings, (f"pixel budget: {settings.decode.max_pixels:,} px per image "
                      f"({settings.decode.max_pixels / 1e6:.1f} MP; --max-pixels N or decode.max_pixels changes it)")


def own_topics_and_groups(settings: Any, suffix: str) -> Any:
    """Topics and consumer groups of a run's own: the configured names + '.' + ``suffix``."""
    t = settings.topics
    names = {name: f"{getattr(t, name)}.{suffix}"
             for name in ("documents", "images", "descriptions", "embeddings", "results", "summaries", "deadletter")}
    return settings.model_copy(update={
        "topics": t.model_copy(update=names),
        "decode": settings.decode.model_copy(update={"group_id": f"{settings.decode.group_id}.{suffix}"}),
        "infer": settings.infer.model_copy(update={"group_id": f"{settings.infer.group_id}.{suffix}"}),
        "condense": settings.condense.model_copy(update={"group_id": f"{settings.condense.group_id}.{suffix}"}),
    })


def fresh_settings(settings: Any) -> Any:
    """--fresh: topics and consumer groups of this run's own, the configured names + '.run-<time>-<random>'."""
    import uuid

    return own_topics_and_groups(settings, f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}")

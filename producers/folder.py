"""Folders of images as documents: each subfolder one document (or each file, ``per_file``), its images in
natural order, a multi-page TIFF or a PDF as one image per page."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

from producers.items import Rejection, natural_key, pdf_page_uris, replace_non_utf8, validated
from schemas import DocumentRef, SchemaError
from vlmstream.images.pdf import DEFAULT_MAX_PAGES as DEFAULT_MAX_PDF_PAGES

# What a folder source picks up: every format the decode stage reads (it decides by content, not by name).
IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".webp", ".gif", ".tif", ".tiff", ".bmp", ".jp2", ".j2k",
                              ".jpf", ".jpx", ".heic", ".heif", ".avif", ".pbm", ".pgm", ".ppm", ".pnm", ".qoi",
                              ".pdf"})


def _is_image_name(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _image_files(root: Path, *, recursive: bool, unreadable: list[OSError] | None = None,
                 skipped: list[Path] | None = None) -> list[Path]:
    """Image files below root. A folder that cannot be listed is added to ``unreadable`` (os.walk would skip it
    without a word, and its document would go out without its images); a visible file of another type to
    ``skipped``, when given, so that the caller can say what it left out."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root, onerror=None if unreadable is None else unreadable.append):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")] if recursive else []
        for f in filenames:
            if f.startswith("."):
                continue
            if _is_image_name(f):
                found.append(Path(dirpath, f))
            elif skipped is not None:
                skipped.append(Path(dirpath, f))
    return found


def folder_groups(root: str | Path, *, per_file: bool = False,
                  skipped: list[Path] | None = None) -> dict[str, list[Path] | OSError]:
    """doc_id -> image files, in natural order, or the error that kept a folder of it from being listed.

    Default: each subfolder of ``root`` (images found recursively) is one document and each image file
    directly in ``root`` is a document of its own, so a folder without subfolders is per-file already.
    ``per_file``: every image file anywhere below ``root`` is one document. Ids are relative paths; a folder
    that cannot be listed is reported under its own. Visible files of a type not in IMAGE_EXTENSIONS are added
    to ``skipped`` when it is given; hidden files and folders are skipped without a word.
    """
    root = Path(root).absolute()
    groups: dict[str, list[Path] | OSError] = {}
    if per_file:
        unreadable: list[OSError] = []
        for path in _image_files(root, recursive=True, unreadable=unreadable, skipped=skipped):
            groups[path.relative_to(root).as_posix()] = [path]
        for error in unreadable:
            groups[Path(error.filename).relative_to(root).as_posix() + "/"] = error
    else:
        for entry in os.scandir(root):
            if entry.name.startswith("."):
                continue
            if entry.is_dir():
                unreadable = []
                files = _image_files(Path(entry.path), recursive=True, unreadable=unreadable, skipped=skipped)
                if unreadable:
                    groups[entry.name] = unreadable[0]
                elif files:
                    groups[entry.name] = files
            elif _is_image_name(entry.name):
                groups[entry.name] = [Path(entry.path)]
            elif skipped is not None:
                skipped.append(Path(entry.path))
    for files in groups.values():
        if isinstance(files, list):
            files.sort(key=lambda p: natural_key(p.relative_to(root).as_posix()))
    return dict(sorted(groups.items(), key=lambda kv: natural_key(kv[0])))


def skipped_files_line(skipped: list[Path], root: str | Path, shown: int = 3) -> str:
    """One line for the files a folder scan left out for their type: how many, and the first few by name."""
    names = ", ".join(Path(p).relative_to(Path(root).absolute()).as_posix() for p in sorted(skipped)[:shown])
    more = f" and {len(skipped) - shown} more" if len(skipped) > shown else ""
    return (f"{len(skipped)} file{'s' if len(skipped) != 1 else ''} left out, not of an image type vlmstream reads "
            f"(by name): {names}{more}")


def page_uris(path: Path, max_pdf_pages: int = DEFAULT_MAX_PDF_PAGES) -> list[str]:
    """A multi-page TIFF (scans, faxes) or a PDF as one URI per page, ``path#page=N``, so that every page is
    described; any other file as itself. A file that cannot be read goes as it is: the decode stage says what is
    wrong. So does a TIFF of ``MAX_PAGES`` pages or more (the decode stage describes its first and notes the rest)
    and a PDF of more than ``max_pdf_pages`` (decode.max_pdf_pages: a dead letter naming the setting)."""
    suffix = path.suffix.lower()
    if suffix == ".pdf":
        return pdf_page_uris(str(path), max_pdf_pages)
    if suffix not in (".tif", ".tiff"):
        return [str(path)]
    from PIL import Image  # only folders with TIFFs pay for the import

    from vlmstream.images.pages import MAX_PAGES, count_pages

    try:
        with Image.open(path) as image:
            pages = count_pages(image)  # a walk over the page directories, no pixels
    except Exception:  # noqa: BLE001 - any failure is the decode stage's to name
        return [str(path)]
    return [str(path)] if not 1 < pages < MAX_PAGES else [f"{path}#page={n}" for n in range(1, pages + 1)]


def folder_document(root: Path, doc_id: str, files: list[Path] | OSError,
                    max_pdf_pages: int = DEFAULT_MAX_PDF_PAGES) -> DocumentRef | Rejection:
    """One of ``folder_groups``' entries as a document, or as a rejection when its folder could not be listed or
    the schema refuses it."""
    if isinstance(files, OSError):
        return Rejection(f"folder:{root}", None, "unreadable_folder",
                         f"{files.filename}: {files.strerror or files}; its document is not published without "
                         "the images it may hold", doc_id.encode("utf-8", "surrogateescape"), doc_id)
    try:
        return validated(DocumentRef(doc_id=doc_id, image_uris=tuple(uri for p in files for uri in page_uris(p, max_pdf_pages)),
                                     source=f"folder:{root}"))
    except SchemaError as exc:
        return Rejection(f"folder:{root}", None, "schema_violation", f"{replace_non_utf8(doc_id)}: {exc}",
                         doc_id.encode("utf-8", "surrogateescape"), doc_id)


def scan_folder(root: str | Path, *, per_file: bool = False, skipped: list[Path] | None = None,
                max_pdf_pages: int = DEFAULT_MAX_PDF_PAGES) -> Iterator[DocumentRef | Rejection]:
    """``folder_groups``' documents (or rejections); files of other types are added to ``skipped`` when given."""
    root = Path(root).absolute()
    for doc_id, files in folder_groups(root, per_file=per_file, skipped=skipped).items():
        yield folder_document(root, doc_id, files, max_pdf_pages)

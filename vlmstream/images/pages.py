"""Multi-page files (TIFF scans and faxes, animations): the `#page=N` selector of a URI and a bounded page count.
Producers count pages to publish each page of a folder's TIFF; the decode stage picks the page a URI names."""

from __future__ import annotations

import re

from PIL import Image

_PAGE_SELECTOR = re.compile(r"^(?P<uri>.+)#page=(?P<page>[1-9][0-9]{0,5})$", re.DOTALL)


# Pages are counted up to this many. Pillow's own count (`n_frames`) walks every page directory and is quadratic
# in them: an 11 MB TIFF of 100,000 one-pixel pages took 54 s.
MAX_PAGES = 1000


def count_pages(image: Image.Image, limit: int | None = None) -> int:
    """Pages (frames) of an open image, counted up to ``limit`` (default ``MAX_PAGES``); the image is left on the
    page it was on."""
    if not getattr(image, "is_animated", False):
        return 1
    limit = limit or MAX_PAGES
    current = image.tell()
    try:
        for page in range(1, limit):
            try:
                image.seek(page)
            except EOFError:
                return page
        return limit
    finally:
        image.seek(current)


def split_page(uri: str) -> tuple[str, int | None]:
    """``(uri without the selector, page)``; page None when the URI names no page."""
    match = _PAGE_SELECTOR.match(uri)
    return (match["uri"], int(match["page"])) if match else (uri, None)

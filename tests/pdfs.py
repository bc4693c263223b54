"""PDFs made in the tests, a few kB each: hand-written text pages (any size and /Rotate), scanned pages (an image
on a page, Pillow's PDF writer), and the hostile set (encrypted, cut, a cross-reference table pointing nowhere, a page
of absurd size, too many pages, a render that never ends, a script)."""

from __future__ import annotations

from io import BytesIO

import numpy as np
from PIL import Image, ImageDraw


def assemble(objects: dict[int, bytes], trailer: bytes = b"") -> bytes:
    """Objects (number -> body) as a PDF with a correct cross-reference table; object 1 is the catalog."""
    out = bytearray(b"%PDF-1.7\n%\xe2\xe3\xcf\xd3\n")
    offsets = {}
    for number in sorted(objects):
        offsets[number] = len(out)
        out += b"%d 0 obj\n" % number + objects[number] + b"\nendobj\n"
    xref = len(out)
    size = max(objects) + 1
    out += b"xref\n0 %d\n0000000000 65535 f \n" % size
    for number in range(1, size):
        out += b"%010d 00000 n \n" % offsets[number] if number in offsets else b"0000000000 65535 f \n"
    out += b"trailer\n<< /Size %d /Root 1 0 R " % size + trailer + b">>\nstartxref\n%d\n%%%%EOF\n" % xref
    return bytes(out)


def _number(value: float) -> bytes:
    """A PDF number: digits and a point, never an exponent (which PDF does not have)."""
    return (b"%.3f" % value).rstrip(b"0").rstrip(b".")


def _stream(body: bytes, extra: bytes = b"") -> bytes:
    return b"<< /Length %d " % len(body) + extra + b">>\nstream\n" + body + b"\nendstream"


def text_pdf(pages: list[tuple[float, float, int, str]], *, catalog_extra: bytes = b"",
             extra_objects: dict[int, bytes] | None = None, resources_extra: bytes = b"") -> bytes:
    """One page per (width_pt, height_pt, rotate, text): the text in Helvetica at the top left and a blue box at
    the bottom left, so that a test can tell the page upright."""
    objects = {3: b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"}
    kids = []
    number = 10
    for width, height, rotate, text in pages:
        page, content = number, number + 1
        number += 2
        kids.append(b"%d 0 R" % page)
        body = f"BT /F1 24 Tf 36 {_number(height - 60).decode()} Td ({text}) Tj ET 0 0 1 rg 36 36 100 50 re f".encode()
        objects[page] = (b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 %s %s] /Rotate %d " % (
                             _number(width), _number(height), rotate)
                         + b"/Resources << /Font << /F1 3 0 R >> " + resources_extra
                         + b">> /Contents %d 0 R >>" % content)
        objects[content] = _stream(body)
    objects[1] = b"<< /Type /Catalog /Pages 2 0 R " + catalog_extra + b">>"
    objects[2] = b"<< /Type /Pages /Kids [" + b" ".join(kids) + b"] /Count %d >>" % len(kids)
    objects.update(extra_objects or {})
    return assemble(objects)


def report_page_content(width: float, height: float, seed: int, *, text: bool = True) -> bytes:
    """A typed report page's drawing: a title and 55 lines of 10 pt Helvetica (``text``), a table's 0.5 pt rules and
    a filled bar chart."""
    rng = np.random.default_rng(seed)
    words = ["invoice", "total", "delivery", "the", "of", "account", "report", "quarter", "2024", "amount", "due",
             "customer", "reference", "page", "section", "summary", "and", "to", "in", "for"]
    lines = [f"BT /F1 20 Tf 50 {height - 60:g} Td (Quarterly report {seed}) Tj ET"] if text else []
    for row in range(55 if text else 0):
        lines.append(f"BT /F1 10 Tf 50 {height - 90 - row * 12:g} Td ({' '.join(rng.choice(words, 12))}) Tj ET")
    for column in range(6):
        lines.append(f"0.5 w {50 + column * 80} 120 m {50 + column * 80} 300 l S")
    for bar in range(10):
        lines.append(f"0.{bar} 0.3 0.7 rg {width - 250 + bar * 20} 100 15 {rng.integers(20, 200)} re f")
    return "\n".join(lines).encode()


def report_pdf(pages: list[tuple[float, float, int]], *, text: bool = True) -> bytes:
    """One ``report_page_content`` page per (width_pt, height_pt, rotate)."""
    objects = {3: b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"}
    kids = []
    for index, (width, height, rotate) in enumerate(pages):
        page, content = 10 + 2 * index, 11 + 2 * index
        kids.append(b"%d 0 R" % page)
        objects[page] = (b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 %s %s] /Rotate %d " % (
                             _number(width), _number(height), rotate)
                         + b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % content)
        objects[content] = _stream(report_page_content(width, height, index, text=text))
    objects[1] = b"<< /Type /Catalog /Pages 2 0 R >>"
    objects[2] = b"<< /Type /Pages /Kids [" + b" ".join(kids) + b"] /Count %d >>" % len(kids)
    return assemble(objects)


def scanned_pdf(sizes: list[tuple[int, int]], resolution: float = 150.0) -> bytes:
    """A scan: each page one photo-like image (``sizes`` in pixels) at ``resolution`` dpi, nothing else on it."""
    rng = np.random.default_rng(len(sizes))
    scans = []
    for index, (width, height) in enumerate(sizes):
        base = np.linspace(40, 220, width, dtype=np.float32)[None, :, None].repeat(height, 0).repeat(3, 2)
        noise = rng.normal(0, 6, (height, width, 3))
        image = Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))
        ImageDraw.Draw(image).rectangle((width // 8, height // 8, width // 3, height // 4), fill=(200, 30, 30))
        ImageDraw.Draw(image).text((width // 2, height // 2), f"scanned page {index + 1}", fill=(0, 0, 0))
        scans.append(image)
    out = BytesIO()
    scans[0].save(out, "PDF", save_all=True, append_images=scans[1:], resolution=resolution)
    return out.getvalue()


def ruled_scan_pdf() -> bytes:
    """Two scanned pages as a scanner writes them (a 300 dpi letter and an A4 at 200 dpi, each one JPEG of quality
    85): dark rules and a filled block on paper noise, the sharp edges a photo has few of."""
    rng = np.random.default_rng(0)
    scans = []
    for width, height in ((2550, 3300), (1654, 2339)):
        paper = np.full((height, width, 3), 236, np.float32) + rng.normal(0, 4, (height, width, 3))
        image = Image.fromarray(np.clip(paper, 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(image)
        for row in range(60):
            y = height // 12 + row * (height // 70)
            length = int(rng.integers(width // 3, width * 3 // 4))
            draw.rectangle((width // 10, y, width // 10 + length, y + height // 200), fill=(40, 40, 40))
        draw.rectangle((width // 2, height * 2 // 3, width * 9 // 10, height * 9 // 10), fill=(180, 60, 40))
        scans.append(image)
    out = BytesIO()
    scans[0].save(out, "PDF", save_all=True, append_images=scans[1:], resolution=300.0, quality=85)
    return out.getvalue()


def encrypted_pdf() -> bytes:
    """The standard security handler with a user password (its check values random): PDFium asks for it."""
    rng = np.random.default_rng(1)
    encrypt = (b"<< /Filter /Standard /V 1 /R 2 /O <" + rng.bytes(32).hex().encode() + b"> /U <"
               + rng.bytes(32).hex().encode() + b"> /P -4 >>")
    source = text_pdf([(612, 792, 0, "secret")], extra_objects={99: encrypt})
    return source.replace(b"/Root 1 0 R ", b"/Root 1 0 R /Encrypt 99 0 R /ID [<00112233445566778899aabbccddeeff> "
                          b"<00112233445566778899aabbccddeeff>] ")


def xref_to_nowhere() -> bytes:
    """Cross-reference offsets past the end and the object keywords gone: nothing left to rebuild it from."""
    good = text_pdf([(612, 792, 0, "lost")])
    broken = good.replace(b" 0 obj", b" 0 xbj").replace(b"endobj", b"endxbj")
    head, _, tail = broken.partition(b"xref\n")
    return head + b"xref\n" + tail.replace(b" 00000 n ", b" 00000 n ").replace(b"0000000", b"9999999")


def absurd_page() -> bytes:
    """A page of 14 million points a side (PDF's own limit is 14,400): billions of pixels at any resolution."""
    return text_pdf([(14_000_000, 14_000_000, 0, "huge")])


def many_pages(count: int) -> bytes:
    """``count`` pages, each the same page object listed again in the page tree: a few bytes per page."""
    good = text_pdf([(612, 792, 0, "again")])
    return good.replace(b"/Kids [10 0 R] /Count 1", b"/Kids [" + b"10 0 R " * count + b"] /Count %d" % count)


def endless_render(depth: int = 7, fan_out: int = 12) -> bytes:
    """A form drawing a form ``fan_out`` times, ``depth`` levels down (fan_out ** depth small paths): a few kB
    that take PDFium hours to draw. Each level's form is one drawing step, so nothing between steps can stop it."""
    objects = {}
    leaf = 50
    objects[leaf] = _stream(b"0 0 1 1 re f", b"/Type /XObject /Subtype /Form /BBox [0 0 100 100] ")
    for level in range(1, depth + 1):
        number = leaf + level
        draws = b" ".join(b"q 1 0 0 1 %d %d cm /X Do Q" % (i % 5, i // 5) for i in range(fan_out))
        objects[number] = _stream(draws, b"/Type /XObject /Subtype /Form /BBox [0 0 100 100] "
                                  b"/Resources << /XObject << /X %d 0 R >> >> " % (number - 1))
    top = leaf + depth
    page = text_pdf([(612, 792, 0, "slow")], extra_objects=objects,
                    resources_extra=b"/XObject << /X %d 0 R >> " % top)
    return page.replace(b"0 0 1 rg 36 36 100 50 re f", b"0 0 1 rg 36 36 100 50 re f /X Do")


def javascript_pdf() -> bytes:
    """A page whose open action is JavaScript (it would change the page and alert); it must render as it is."""
    script = _stream(b"app.alert('ran'); this.getField('x'); this.print();")
    return text_pdf([(612, 792, 0, "scripted")], catalog_extra=b"/OpenAction << /S /JavaScript /JS 90 0 R >> "
                    b"/Names << /JavaScript << /Names [(run) << /S /JavaScript /JS 90 0 R >>] >> >> ",
                    extra_objects={90: script})


def hostile_set(page_limit: int) -> dict[str, tuple[bytes, str, str]]:
    """name -> (bytes, the error_kind the decode stage reports, a word its detail must hold: the setting)."""
    good = text_pdf([(612, 792, 0, "cut short")] * 2)
    return {
        "encrypted": (encrypted_pdf(), "decode_pdf_encrypted", "password"),
        "truncated": (good[:200], "decode_corrupt", "PDFium"),
        "xref_to_nowhere": (xref_to_nowhere(), "decode_corrupt", "PDFium"),
        "absurd_page": (absurd_page(), "decode_too_many_pixels", "decode.max_source_pixels"),
        "too_many_pages": (many_pages(page_limit + 1), "decode_pdf_too_many_pages", "decode.max_pdf_pages"),
        "endless_render": (endless_render(), "decode_pdf_render_timeout", "decode.pdf_render_time_limit_s"),
    }

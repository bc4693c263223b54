"""PDF pages to the model's input, per core: ours against the usual route, on pages made here.

  ours:     the decode stage's PDF path (``Decoder.decode``: PDFium, in the decoder's render child, opens the
            document and draws the page straight at the family's target size for the page at decode.pdf_dpi; a
            page that is one JPEG, a scanner's, is that JPEG decoded at a DCT scale and resized, as the stage does);
  baseline: ``pdftoppm -r 200`` (poppler) rasterises the page, Pillow reads it, and transformers'
            Qwen2VLImageProcessor's resize (its ``resize`` with the processor's own resample) takes it to the same
            output size.

CPU time, not wall time: this process's, pdftoppm's and the render child's user + system seconds, so other work
on a shared machine does not count; every library on one thread. The ratio is baseline CPU / ours per page.
Pixels: ours against the baseline's output as normalised values (CLIP mean/std), mean and 99th percentile of
|diff|, against tests/test_decode_equivalence.py's tolerance (mean < 0.045, p99 < 0.32), and beside it the
baseline's own spread: the same route from a 300 dpi raster against the 200 dpi one (that tolerance is for one
decoded image resized two ways; two rasterisations of text and scans differ by more whichever renderer makes them).

Usage: python benchmarks/bench_pdf_render.py [--repeat N] [--out FILE]
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

BUDGETS = {"0.2 MP": 256 * 28 * 28, "1 MP": 1280 * 28 * 28, "default (12.8 MP)": 16384 * 28 * 28}
MEAN_LIMIT, P99_LIMIT = 0.045, 0.32  # tests/test_decode_equivalence.py
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


def cpu_seconds(renderer=None) -> float:
    """This process's CPU, its reaped children's (pdftoppm) and the PDF renderer's running child's."""
    import resource

    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (time.process_time() + children.ru_utime + children.ru_stime
            + (renderer.child_cpu_seconds() if renderer is not None else 0.0))


def pin_one_thread() -> None:
    for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[name] = "1"
    import cv2
    import torch

    cv2.setNumThreads(1)
    torch.set_num_threads(1)


def text_page_content(width: float, height: float, seed: int) -> bytes:
    """A typed page: a title, 55 lines of 10 pt text, a table's rules and a filled chart."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words = ["invoice", "total", "delivery", "the", "of", "account", "report", "quarter", "2024", "amount", "due",
             "customer", "reference", "page", "section", "summary", "and", "to", "in", "for"]
    lines = [f"BT /F1 20 Tf 50 {height - 60:g} Td (Quarterly report {seed}) Tj ET"]
    for row in range(55):
        text = " ".join(rng.choice(words, 12))
        lines.append(f"BT /F1 10 Tf 50 {height - 90 - row * 12:g} Td ({text}) Tj ET")
    for column in range(6):
        lines.append(f"0.5 w {50 + column * 80} 120 m {50 + column * 80} 300 l S")
    for bar in range(10):
        lines.append(f"0.{bar} 0.3 0.7 rg {width - 250 + bar * 20} 100 15 {rng.integers(20, 200)} re f")
    return "\n".join(lines).encode()


def make_documents(folder: Path) -> dict[str, tuple[bytes, int]]:
    """name -> (PDF bytes, pages): typed pages (letter, A4 landscape, letter turned by /Rotate), and scans (a 300 dpi
    letter JPEG, an A4 at 200 dpi), each page as a real document has it."""
    import numpy as np
    from PIL import Image, ImageDraw

    from tests.pdfs import _stream, assemble

    objects = {3: b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"}
    kids = []
    for index, (width, height, rotate) in enumerate([(612, 792, 0), (842, 595, 0), (612, 792, 90), (595, 842, 0)]):
        page, content = 10 + 2 * index, 11 + 2 * index
        kids.append(b"%d 0 R" % page)
        objects[page] = (b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 %d %d] /Rotate %d " % (width, height, rotate)
                         + b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % content)
        objects[content] = _stream(text_page_content(width, height, index))
    objects[1] = b"<< /Type /Catalog /Pages 2 0 R >>"
    objects[2] = b"<< /Type /Pages /Kids [" + b" ".join(kids) + b"] /Count %d >>" % len(kids)
    typed = assemble(objects)

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
    out = io.BytesIO()
    scans[0].save(out, "PDF", save_all=True, append_images=scans[1:], resolution=300.0, quality=85)
    scanned = out.getvalue()
    documents = {"typed": (typed, 4), "scanned": (scanned, 2)}
    for name, (data, _pages) in documents.items():
        (folder / f"{name}.pdf").write_bytes(data)
    return documents


def poppler_page(path: Path, page: int, dpi: int = 200):
    """pdftoppm's raster of one page (PPM on stdout: no compression to pay for), as a PIL image."""
    from PIL import Image

    raster = subprocess.run(["pdftoppm", "-r", str(dpi), "-f", str(page), "-l", str(page), str(path)],
                            capture_output=True, check=True).stdout
    return Image.open(io.BytesIO(raster)).convert("RGB")


def scan_image(data: bytes, page: int):
    """The JPEG a scanned page holds, decoded by Pillow in full."""
    import numpy as np
    import pypdfium2
    from PIL import Image

    document = pypdfium2.PdfDocument(data)
    try:
        [image] = document[page - 1].get_objects()
        return np.asarray(Image.open(io.BytesIO(bytes(image.get_data()))).convert("RGB"))
    finally:
        document.close()


def normalised(pixels):
    import numpy as np

    mean = np.asarray(CLIP_MEAN, np.float32)
    std = np.asarray(CLIP_STD, np.float32)
    return (pixels.astype(np.float32) / 255.0 - mean) / std


def run(repeat: int) -> list[str]:
    import numpy as np
    from transformers import Qwen2VLImageProcessor
    from transformers.image_transforms import resize

    from consumers.decode.decoder import Decoder
    from consumers.decode.resize import resize_exact
    from vlmstream.models.qwen2_vl import QWEN2_VL

    processor = Qwen2VLImageProcessor()
    lines = ["| budget | document | pages | ours CPU ms/page | pdftoppm -r 200 + processor resize CPU ms/page "
             "| ratio per core | mean abs diff | p99 abs diff | within tolerance | pdftoppm -r 300 against -r 200, "
             "both through the processor: mean / p99 | scans against the processor on the page's own JPEG: "
             "ours / baseline (mean) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        documents = make_documents(folder)
        for budget_name, budget in BUDGETS.items():
            decoder = Decoder(family=QWEN2_VL, min_pixels=56 * 56, max_pixels=budget)
            for name, (data, pages) in documents.items():
                ours_cpu = base_cpu = 0.0
                diffs, spreads, to_image = [], [], ([], [])
                for _ in range(repeat):
                    for page in range(1, pages + 1):
                        start = cpu_seconds(decoder.pdf_renderer)
                        decoded = decoder.decode(data, page)
                        height, width = decoded.target_height, decoded.target_width
                        pixels = resize_exact(decoded.pixels, height, width)  # a scan's JPEG: as the stage does
                        ours_cpu += cpu_seconds(decoder.pdf_renderer) - start

                        start = cpu_seconds()
                        raster = np.asarray(poppler_page(folder / f"{name}.pdf", page))
                        reference = resize(raster, (height, width), resample=processor.resample,
                                           input_data_format="channels_last")
                        base_cpu += cpu_seconds() - start
                        diffs.append(np.abs(normalised(pixels) - normalised(reference)).ravel())
                        # The yardstick: the same route from a 300 dpi raster against the 200 dpi one.
                        finer = resize(np.asarray(poppler_page(folder / f"{name}.pdf", page, 300)), (height, width),
                                       resample=processor.resample, input_data_format="channels_last")
                        spreads.append(np.abs(normalised(finer) - normalised(reference)).ravel())
                        if name == "scanned":  # the processor on the page's own JPEG: no rasteriser between
                            own = resize(scan_image(data, page), (height, width), resample=processor.resample,
                                         input_data_format="channels_last")
                            to_image[0].append(np.abs(normalised(pixels) - normalised(own)).ravel())
                            to_image[1].append(np.abs(normalised(reference) - normalised(own)).ravel())
                count = repeat * pages
                diff = np.concatenate(diffs)
                mean, p99 = float(diff.mean()), float(np.percentile(diff, 99))
                spread = np.concatenate(spreads)
                lines.append(f"| {budget_name} | {name} | {pages} | {1000 * ours_cpu / count:.1f} | "
                             f"{1000 * base_cpu / count:.1f} | {base_cpu / ours_cpu:.2f}x | {mean:.4f} | {p99:.3f} | "
                             f"{'yes' if mean < MEAN_LIMIT and p99 < P99_LIMIT else 'no'} | "
                             f"{float(spread.mean()):.4f} / {float(np.percentile(spread, 99)):.3f} | "
                             f"{' / '.join(f'{float(np.concatenate(d).mean()):.4f}' for d in to_image if d) or '-'} |")
                print(lines[-1], flush=True)
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="Also write the table (Markdown) here.")
    args = parser.parse_args()
    pin_one_thread()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    poppler = subprocess.run(["pdftoppm", "-v"], capture_output=True, text=True).stderr.splitlines()[0]
    import pypdfium2

    header = [f"# PDF page to model input, CPU time per page ({started})", "",
              f"CPU seconds (process time) of this process, pdftoppm and the PDF renderer's child, one thread each, on "
              f"a machine shared with other work (CPU time, not wall time, for that reason); {poppler}; "
              f"pypdfium2 {pypdfium2.PYPDFIUM_INFO} (PDFium {pypdfium2.PDFIUM_INFO}); {args.repeat} passes. "
              "Ratio = baseline CPU / ours.", ""]
    print("\n".join(header), flush=True)
    lines = run(args.repeat)
    if args.out:
        args.out.write_text("\n".join(header + lines) + "\n")


if __name__ == "__main__":
    main()

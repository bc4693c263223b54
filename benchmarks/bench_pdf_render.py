"""PDF pages to the model's input, per core: ours against the usual route, on pages made here.

  ours:     the decode stage's PDF path (``Decoder.decode``: PDFium, in the decoder's render child, opens the
            document and draws the page at its decode.pdf_dpi size, at most 6x the family's target on each axis,
            then shrinks it as the stage does; a page that is one JPEG, a scanner's, is that JPEG decoded whole
            and shrunk with the processor's kernel, and is measured against the processor on that JPEG);
  baseline: ``pdftoppm -r 200`` (poppler) rasterises the page, Pillow reads it, and transformers'
            Qwen2VLImageProcessor's resize (its ``resize`` with the processor's own resample) takes it to the same
            output size.

CPU time, not wall time: this process's, pdftoppm's and the render child's user + system seconds, so other work
on a shared machine does not count; every library on one thread. The ratio is baseline CPU / ours per page.
Pixels: ours against the baseline's output as normalised values (CLIP mean/std), mean and 99th percentile of
|diff|, against tests/test_decode_equivalence.py's tolerance (mean < 0.045, p99 < 0.32), and beside it the
baseline's own spread: the same route from a 300 dpi raster against the 200 dpi one (that tolerance is for one
decoded image resized two ways; two rasterisations of text and scans differ by more whichever renderer makes them).
The baseline's route with PDFium for poppler (PDFium drawing the page at pdftoppm's own 200 dpi size, then the
processor's resize) takes that gap apart: ours against it (the same rasteriser, two routes to the model's size: what
the tolerance is for), and it against the baseline (the two rasterisers at one size: what no route drawn by PDFium
gets under); a drawn page of rules and filled shapes only (no glyph, no image) is where the rasterisers agree. Each
budget ends with a line saying whether the speed (>= 3x per core) and the pixels (the tolerance) hold. A second
table holds both routes against a reference each should approach: the page drawn at 600 dpi by each rasteriser and
taken to the same size by the processor's resize (ours against PDFium's, the baseline against poppler's, and each
against the other's), beside how far the two 600 dpi routes are apart.

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


def make_documents(folder: Path) -> dict[str, tuple[bytes, int]]:
    """name -> (PDF bytes, pages): typed pages (letter, A4 landscape, letter turned by /Rotate), and scans (a 300 dpi
    letter JPEG, an A4 at 200 dpi), each page as a real document has it; and a drawn page of the typed pages' rules
    and shapes without their text (letter, A4 turned by /Rotate)."""
    from tests.pdfs import report_pdf, ruled_scan_pdf

    pages = [(612, 792, 0), (842, 595, 0), (612, 792, 90), (595, 842, 0)]
    typed = report_pdf(pages)
    drawn = report_pdf([(612, 792, 0), (842, 595, 90)], text=False)
    scanned = ruled_scan_pdf()
    documents = {"typed": (typed, 4), "scanned": (scanned, 2), "drawn (no text)": (drawn, 2)}
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


def mean_p99_of(parts, digits=4) -> str:
    import numpy as np

    diff = np.concatenate(parts)
    return f"{float(diff.mean()):.{digits}f} / {float(np.percentile(diff, 99)):.3f}"


def normalised(pixels):
    import numpy as np

    mean = np.asarray(CLIP_MEAN, np.float32)
    std = np.asarray(CLIP_STD, np.float32)
    return (pixels.astype(np.float32) / 255.0 - mean) / std


def run(repeat: int) -> list[str]:
    import numpy as np
    import pypdfium2
    from transformers import Qwen2VLImageProcessor
    from transformers.image_transforms import resize

    from consumers.decode.decoder import Decoder
    from consumers.decode.resize import resize_exact
    from vlmstream.images.pdf import render_page
    from vlmstream.models.qwen2_vl import QWEN2_VL

    processor = Qwen2VLImageProcessor()

    def to_target(pixels, height, width):
        return resize(pixels, (height, width), resample=processor.resample, input_data_format="channels_last")

    lines = ["| budget | document | pages | ours CPU ms/page | pdftoppm -r 200 + processor resize CPU ms/page "
             "| ratio per core | mean abs diff | p99 abs diff | within tolerance | ours against PDFium at "
             "pdftoppm's size + processor resize: mean / p99 | that route against the baseline: mean "
             "| pdftoppm -r 300 against -r 200, both through the "
             "processor: mean / p99 | scans against the processor on the page's own JPEG, mean / p99: ours; baseline |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    fine_lines = ["| budget | document | ours against PDFium's 600 dpi raster through the processor: mean / p99 "
                  "| baseline against pdftoppm's 600 dpi raster through the processor: mean / p99 "
                  "| ours / baseline against pdftoppm's 600 dpi route: mean | ours / baseline against PDFium's 600 "
                  "dpi route: mean | the two 600 dpi routes against each other: mean / p99 |",
                  "|---|---|---|---|---|---|---|"]
    verdicts = []
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        documents = make_documents(folder)
        for budget_name, budget in BUDGETS.items():
            decoder = Decoder(family=QWEN2_VL, min_pixels=56 * 56, max_pixels=budget)
            verdict = []
            for name, (data, pages) in documents.items():
                ours_cpu = base_cpu = 0.0
                diffs, spreads, floors, sames, to_image = [], [], [], [], ([], [])
                fine = {key: [] for key in ("ours_own", "base_own", "ours_poppler", "base_pdfium", "fines")}
                pdfium = pypdfium2.PdfDocument(data)
                for rep in range(repeat):
                    for page in range(1, pages + 1):
                        start = cpu_seconds(decoder.pdf_renderer)
                        decoded = decoder.decode(data, page)
                        height, width = decoded.target_height, decoded.target_width
                        pixels = resize_exact(decoded.pixels, height, width)  # a scan's JPEG: as the stage does
                        ours_cpu += cpu_seconds(decoder.pdf_renderer) - start

                        start = cpu_seconds()
                        raster = np.asarray(poppler_page(folder / f"{name}.pdf", page))
                        reference = to_target(raster, height, width)
                        base_cpu += cpu_seconds() - start
                        diffs.append(np.abs(normalised(pixels) - normalised(reference)).ravel())
                        # PDFium in poppler's place, at its size: the renderers' own difference, through the resize.
                        same = to_target(render_page(pdfium, page, raster.shape[1], raster.shape[0]), height, width)
                        floors.append(np.abs(normalised(same) - normalised(reference)).ravel())
                        sames.append(np.abs(normalised(pixels) - normalised(same)).ravel())
                        # The yardstick: the same route from a 300 dpi raster against the 200 dpi one.
                        finer = to_target(np.asarray(poppler_page(folder / f"{name}.pdf", page, 300)), height, width)
                        spreads.append(np.abs(normalised(finer) - normalised(reference)).ravel())
                        if rep == 0:  # a reference both routes approach: each rasteriser at 600 dpi, then the resize
                            poppler_fine = np.asarray(poppler_page(folder / f"{name}.pdf", page, 600))
                            pdfium_fine = render_page(pdfium, page, poppler_fine.shape[1], poppler_fine.shape[0])
                            poppler_fine = normalised(to_target(poppler_fine, height, width))
                            pdfium_fine = normalised(to_target(pdfium_fine, height, width))
                            for key, a, b in (("ours_own", normalised(pixels), pdfium_fine),
                                              ("base_own", normalised(reference), poppler_fine),
                                              ("ours_poppler", normalised(pixels), poppler_fine),
                                              ("base_pdfium", normalised(reference), pdfium_fine),
                                              ("fines", pdfium_fine, poppler_fine)):
                                fine[key].append(np.abs(a - b).ravel())
                        if name == "scanned":  # the processor on the page's own JPEG: no rasteriser between
                            own = to_target(scan_image(data, page), height, width)
                            to_image[0].append(np.abs(normalised(pixels) - normalised(own)).ravel())
                            to_image[1].append(np.abs(normalised(reference) - normalised(own)).ravel())
                pdfium.close()
                count = repeat * pages
                diff = np.concatenate(diffs)
                mean, p99 = float(diff.mean()), float(np.percentile(diff, 99))
                within = mean < MEAN_LIMIT and p99 < P99_LIMIT
                same = np.concatenate(sames)
                same_mean, same_p99 = float(same.mean()), float(np.percentile(same, 99))
                same_within = same_mean < MEAN_LIMIT and same_p99 < P99_LIMIT
                spread = np.concatenate(spreads)
                ratio = base_cpu / ours_cpu
                lines.append(f"| {budget_name} | {name} | {pages} | {1000 * ours_cpu / count:.1f} | "
                             f"{1000 * base_cpu / count:.1f} | {ratio:.2f}x | {mean:.4f} | {p99:.3f} | "
                             f"{'yes' if within else 'no'} | {same_mean:.4f} / {same_p99:.3f} | "
                             f"{float(np.concatenate(floors).mean()):.4f} | "
                             f"{float(spread.mean()):.4f} / {float(np.percentile(spread, 99)):.3f} | "
                             f"{'; '.join(mean_p99_of(d) for d in to_image if d) or '-'} |")
                print(lines[-1], flush=True)
                fine = {key: np.concatenate(parts) for key, parts in fine.items()}

                def mean_p99(key):
                    return f"{float(fine[key].mean()):.4f} / {float(np.percentile(fine[key], 99)):.3f}"

                fine_lines.append(f"| {budget_name} | {name} | {mean_p99('ours_own')} | {mean_p99('base_own')} | "
                                  f"{float(fine['ours_poppler'].mean()):.4f} / {float(fine['base_own'].mean()):.4f} | "
                                  f"{float(fine['ours_own'].mean()):.4f} / {float(fine['base_pdfium'].mean()):.4f} | "
                                  f"{mean_p99('fines')} |")
                own = ""
                if to_image[0]:  # what a scan is measured against: the processor on its own JPEG
                    own_diff = np.concatenate(to_image[0])
                    own_within = own_diff.mean() < MEAN_LIMIT and np.percentile(own_diff, 99) < P99_LIMIT
                    own = (f"; against the processor on its own JPEG {mean_p99_of(to_image[0], 3)} "
                           f"({'within' if own_within else 'outside'})")
                verdict.append(f"{name}: {ratio:.1f}x per core ({'at least' if ratio >= 3 else 'under'} 3x); "
                               f"against the baseline mean {mean:.3f} / p99 {p99:.2f} "
                               f"({'within' if within else 'outside'} the tolerance); against PDFium's 200 dpi "
                               f"route {same_mean:.3f} / {same_p99:.2f} ({'within' if same_within else 'outside'}){own}")
            decoder.close()
            verdicts.append(f"- {budget_name}: " + " | ".join(verdict))
    fine_lines = ["", "Both routes against a reference each should approach: the page drawn at 600 dpi, by PDFium and "
                  "by pdftoppm, through the processor's resize to the same output size (first pass only).", "",
                  *fine_lines]
    print("\n".join(["", *verdicts, *fine_lines]), flush=True)
    return lines + ["", *verdicts, *fine_lines]


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

"""The decode stage of this checkout against the same stage at another git revision, side by side on the same
files: did a change make decode faster or slower? One thread; each side runs in its own subprocess (its own
imports), rounds alternate A, B, B, A so that a machine that slows down over time weighs on both sides alike.

Usage: python benchmarks/bench_decode_ab.py REV [--images DIR] [--budgets default,256] [--rounds 4] [--limit N]
                                                [--jpeg-only]
Prints, per budget: img/s of each side per round, the median of the per-round time ratios (this / REV: below 1
means this checkout is faster) and their spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.bench_decode import BUDGETS, collect_images  # noqa: E402

PACKAGES = ("consumers", "schemas", "vlmstream", "producers")


def tree_at(rev: str, into: Path) -> Path:
    """The pipeline's packages as they were at ``rev``."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev, *PACKAGES],
                             check=True, capture_output=True).stdout
    with tarfile.open(fileobj=BytesIO(archive)) as tar:
        tar.extractall(into, filter="data")
    return into


WORKER = r"""
import json, os, sys, time
for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[name] = "1"
import cv2
cv2.setNumThreads(1)
from consumers.decode.stage import DecodeStage
from vlmstream.config import DecodeSettings
files, max_pixels = json.loads(sys.argv[1]), int(sys.argv[2])
stage = DecodeStage(DecodeSettings(max_pixels=max_pixels, allowed_roots=[os.path.dirname(f) for f in files]))
failed = [f for f in files if hasattr(stage(f), "error_kind")]  # warm-up pass: imports, caches, first allocations
started = time.perf_counter()
for f in files:
    stage(f)
print(json.dumps({"seconds": time.perf_counter() - started, "failed": len(failed),
                  "file": sys.modules["consumers.decode.stage"].__file__}))
"""


def one_pass(root: Path, files: list[str], max_pixels: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", WORKER, json.dumps(files), str(max_pixels)], cwd=str(root), env=env,
                         check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["file"].startswith(str(root)), f"imported {result['file']}, not from {root}"
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev")
    ap.add_argument("--images", type=Path)
    ap.add_argument("--budgets", default="default,256")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--jpeg-only", action="store_true")
    args = ap.parse_args()

    files = [str(p) for p in collect_images(args.images, args.jpeg_only)]
    if args.limit:
        files = files[:args.limit]
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", *PACKAGES], capture_output=True,
                           text=True).stdout.strip()
    print(f"A = this checkout ({head}{', with uncommitted changes' if dirty else ''}), B = {args.rev}; "
          f"{len(files)} files, {args.rounds} rounds per budget, one thread")
    summary = {}
    with tempfile.TemporaryDirectory() as tmp:
        before = tree_at(args.rev, Path(tmp))
        for budget in args.budgets.split(","):
            max_pixels = BUDGETS[budget]
            ratios, rates = [], {"A": [], "B": []}
            for r in range(args.rounds):
                order = ("A", "B") if r % 2 == 0 else ("B", "A")
                seconds = {}
                for side in order:
                    result = one_pass(REPO if side == "A" else before, files, max_pixels)
                    seconds[side] = result["seconds"]
                    rates[side].append(len(files) / result["seconds"])
                    if result["failed"]:
                        print(f"  {side}: {result['failed']} files failed to decode (timed all the same)")
                ratios.append(seconds["A"] / seconds["B"])
                print(f"  {budget} round {r + 1}: A {rates['A'][-1]:.2f} img/s, B {rates['B'][-1]:.2f} img/s, "
                      f"time A/B {ratios[-1]:.3f}")
            median = statistics.median(ratios)
            summary[budget] = {"median_time_ratio": round(median, 3), "min": round(min(ratios), 3),
                               "max": round(max(ratios), 3),
                               "a_img_per_s": round(statistics.median(rates["A"]), 2),
                               "b_img_per_s": round(statistics.median(rates["B"]), 2)}
            print(f"RESULT budget={budget} time this/{args.rev} median {median:.3f} "
                  f"(rounds {min(ratios):.3f}-{max(ratios):.3f}); img/s A {summary[budget]['a_img_per_s']}, "
                  f"B {summary[budget]['b_img_per_s']}")
    print("JSON " + json.dumps(summary))


if __name__ == "__main__":
    started = time.monotonic()
    main()
    print(f"({time.monotonic() - started:.0f} s)")

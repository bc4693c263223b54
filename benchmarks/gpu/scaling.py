"""Two GPUs against one, from two pipeline runs' progress files (gpu_bench writes `progress.jsonl`, one line per
30 s): the rates at matched times after each run's first document, overall and over the last 30 s, and their
ratios. Matching times keeps the ramp of each phase (a cold decode fleet, the engine's first batches) on both sides.

    python benchmarks/gpu/scaling.py TWO_GPUS/progress.jsonl ONE_GPU/progress.jsonl [--mode embeds] [--budget 256]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def progress_lines(path: Path, mode: str, budget: str) -> list[dict]:
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in lines if r.get("mode") == mode and str(r.get("budget")) == budget]


def matched(two: list[dict], one: list[dict], tolerance_s: float = 10.0) -> list[dict]:
    """Each line of the two-GPU run with the one-GPU line nearest in time after its first document (within
    tolerance_s), and the ratios of their rates."""
    rows = []
    for t in two:
        nearest = min(one, key=lambda o: abs(o["s_since_first_publish"] - t["s_since_first_publish"]), default=None)
        if nearest is None or abs(nearest["s_since_first_publish"] - t["s_since_first_publish"]) > tolerance_s:
            continue
        rows.append({
            "s_two": t["s_since_first_publish"], "s_one": nearest["s_since_first_publish"],
            "overall_two": t["img_per_s_overall"], "overall_one": nearest["img_per_s_overall"],
            "overall_ratio": round(t["img_per_s_overall"] / nearest["img_per_s_overall"], 2)
            if nearest["img_per_s_overall"] else None,
            "last30_two": t["img_per_s_last_30s"], "last30_one": nearest["img_per_s_last_30s"],
            "last30_ratio": round(t["img_per_s_last_30s"] / nearest["img_per_s_last_30s"], 2)
            if nearest["img_per_s_last_30s"] else None,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("two_gpus", type=Path)
    ap.add_argument("one_gpu", type=Path)
    ap.add_argument("--mode", default="embeds")
    ap.add_argument("--budget", default="256")
    args = ap.parse_args(argv)
    rows = matched(progress_lines(args.two_gpus, args.mode, args.budget),
                   progress_lines(args.one_gpu, args.mode, args.budget))
    if not rows:
        raise SystemExit("no matching times in the two files (same mode and budget?)")
    print(f"{'s after first document':>24} {'overall img/s two / one':>26} {'ratio':>6} "
          f"{'last 30 s two / one':>22} {'ratio':>6}")
    for r in rows:
        print(f"{r['s_two']:>11.1f} / {r['s_one']:<10.1f} {r['overall_two']:>12.2f} / {r['overall_one']:<11.2f}"
              f"{r['overall_ratio']:>6} {r['last30_two']:>10.2f} / {r['last30_one']:<9.2f}{r['last30_ratio']:>6}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

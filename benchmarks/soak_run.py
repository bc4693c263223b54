"""Memory over a long `vlmstream run`: the whole pipeline (local broker, producer, decode fleet, inference on the
built-in tiny model unless --model says otherwise) over N documents that are links to a folder's images, with the
inference consumer's self-profile on, then its resident memory and CPU per minute and the run's summary.

    python benchmarks/soak_run.py --docs 6000 --max-pixels 200704

A leak in the runner, the results aggregator or an engine shows as memory that grows minute after minute; the
first minutes include the model's and the allocator's warm-up.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.images import SUFFIXES, link_documents  # noqa: E402 - after the path insert

SPAN_S = 300.0  # the sustained check compares the first steady and the last spans of this length


def sustained(stamps: list[float], window_s: float = 60.0, span_s: float = SPAN_S,
              input_end: float | None = None) -> dict:
    """Sustained against peak from the times (s) images were described: images/s in each ``window_s`` window from
    the first description, and the rate over the first steady ``span_s`` (after the first window, the warm-up)
    against the rate over the last ``span_s`` that ends by ``input_end`` (when the stage before ran out of work: after
    it, a run only drains what is queued, on cores no longer shared). None for the spans when the run is shorter
    than a warm-up window and two spans."""
    stamps = sorted(stamps)
    if not stamps:
        return {"windows": [], "first_span": None, "last_span": None, "last_over_first": None}
    t0, end = stamps[0], min(stamps[-1], input_end if input_end is not None else stamps[-1])
    windows = []
    start = t0
    while start < end:
        n = sum(1 for t in stamps if start <= t < start + window_s)
        windows.append(round(n / window_s, 2))
        start += window_s

    def rate(a: float, b: float) -> float:
        return sum(1 for t in stamps if a <= t < b) / (b - a)

    if end - t0 < window_s + 2 * span_s:
        return {"windows": windows, "first_span": None, "last_span": None, "last_over_first": None}
    first = rate(t0 + window_s, t0 + window_s + span_s)
    last = rate(end - span_s, end)
    return {"windows": windows, "first_span": round(first, 2), "last_span": round(last, 2),
            "last_over_first": round(last / first, 3) if first else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images",
                    default=os.environ.get("VLMSTREAM_TEST_IMAGES") or str(REPO.parent / "shared" / "corpus"))
    ap.add_argument("--docs", type=int, default=6000)
    ap.add_argument("--max-pixels", type=int, default=200704)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--model", default="", help="Default: the built-in tiny model.")
    ap.add_argument("--window-s", type=float, default=60.0)
    ap.add_argument("--timeout-s", type=float, default=7200.0)
    ap.add_argument("--python-heap", action="store_true",
                    help="Also trace the consumer's Python heap (tracemalloc; slower): a Python leak grows there, "
                    "native memory and allocator high water only in RSS.")
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="vlmstream-soak-"))
    source = Path(args.images).resolve()
    files = sorted(p.resolve() for p in source.rglob("*") if p.suffix.lower() in SUFFIXES)
    if not files:
        raise SystemExit(f"no images under {source}")
    # Symlinks: the corpus may be on another device. The ids carry the run's unique folder name: documents of an
    # earlier run already have results.
    link_documents(files, work / "docs", f"{work.name}-", args.docs, link=os.symlink)
    profile = work / "infer-profile.json"
    env = {**os.environ, "VLMSTREAM_PROFILE_OUT": str(profile), "VLMSTREAM_PROFILE_WINDOW_S": str(args.window_s),
           "VLMSTREAM_DECODE__ALLOWED_ROOTS": json.dumps([str(work), str(source)]),
           "VLMSTREAM_PROFILE_PYTHON_HEAP": "1" if args.python_heap else "0"}
    # Topics and groups of this run alone, unless set: on the default ones a local broker may still hold an earlier
    # run's backlog, which the workers would describe first (seen: an unfinished soak's 7,000 documents).
    for name in ("documents", "images", "descriptions", "embeddings", "results", "deadletter"):
        env.setdefault(f"VLMSTREAM_TOPICS__{name.upper()}", f"{work.name}.{name}")
    for stage in ("decode", "infer"):
        env.setdefault(f"VLMSTREAM_{stage.upper()}__GROUP_ID", f"{work.name}-{stage}")
    cmd = [sys.executable, "-m", "vlmstream.cli", "run", str(work / "docs"), "--per-file", "--force", "--show", "0",
           "--max-pixels", str(args.max_pixels), "--max-new-tokens", str(args.max_new_tokens),
           "--timeout-s", str(args.timeout_s), *(["--model", args.model] if args.model else [])]
    started = time.monotonic()
    done = subprocess.run(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    print(done.stdout[-3000:])  # the run's summary table (and, on failure, why)
    windows = json.loads(profile.read_text())["windows"] if profile.exists() else []
    print(f"{args.docs} documents, {args.max_pixels} px, {time.monotonic() - started:.0f} s; inference consumer, "
          f"one line per {args.window_s:.0f} s window:")
    print(f"{'minute':>6} {'span s':>7} {'cores':>6} {'RSS MB':>8} {'Python heap MB':>15}  most grown since minute 1")
    for i, w in enumerate(windows, 1):
        grown = ", ".join(f"{g['line']} +{g['kb']:.0f} kB" for g in w.get("python_heap_growth", [])[:2])
        print(f"{i:>6} {w['span_s']:>7.1f} {w['process_cores']:>6.2f} {w.get('rss_mb', 0):>8.1f} "
              f"{w['python_heap_mb'] if 'python_heap_mb' in w else '-':>15}  {grown}")
    from benchmarks.topics import read_topic
    from vlmstream.config import load_settings

    settings = load_settings()
    described = [r.timestamp / 1000 for r in read_topic(settings, env["VLMSTREAM_TOPICS__DESCRIPTIONS"])]
    decoded = [r.timestamp / 1000 for r in read_topic(settings, env["VLMSTREAM_TOPICS__IMAGES"])]
    rates = sustained(described, args.window_s, input_end=max(decoded, default=None))
    print(f"images described per second, one {args.window_s:.0f} s window each from the first description: "
          + ", ".join(str(r) for r in sustained(described, args.window_s)["windows"]))
    print("images decoded per second, the same way from the first decoded image: "
          + ", ".join(str(r) for r in sustained(decoded, args.window_s)["windows"]))
    if rates["first_span"] is not None:
        verdict = "within" if abs(rates["last_over_first"] - 1) <= 0.10 else "NOT within"
        print(f"sustained (descriptions): first steady {SPAN_S:.0f} s (after a {args.window_s:.0f} s warm-up) "
              f"{rates['first_span']} img/s, last {SPAN_S:.0f} s before decode ran out of documents "
              f"{rates['last_span']} img/s: last / first {rates['last_over_first']} ({verdict} 10%)")
    else:
        print(f"sustained: the run was too short for a warm-up window and two {SPAN_S:.0f} s spans")
    full = [w.get("rss_mb", 0.0) for w in windows if w["span_s"] >= 0.9 * args.window_s]
    if len(full) >= 4:
        half = len(full) // 2
        print(f"RSS mean, first half of the full windows {sum(full[:half]) / half:.0f} MB, second half "
              f"{sum(full[half:]) / (len(full) - half):.0f} MB, highest {max(full):.0f} MB")
    sys.exit(done.returncode)


if __name__ == "__main__":
    main()

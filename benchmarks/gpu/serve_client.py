"""Multi-process OpenAI-style client for `vllm serve`: P processes keep
C requests in flight in total for --seconds, each request one full-resolution JPEG as a file:// URL; then they wait
for what is in flight. Prints `RESULT {json}`: completed requests over the time from the first request sent to the
last answer received (t0 is wall-clock time.time(), for the GPU sampler).

Usage: serve_client.py --url http://127.0.0.1:8000 --model DIR --imgs DIR --seconds 30 --procs 6 --conc 1024
                       --max-tokens 64 --max-pixels 200704 [--min-pixels 3136] [--prompt TEXT] [--window 30]
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import multiprocessing as mp
import os
import time

from rates import phase_rates  # this script's folder is on sys.path when it runs


def worker(args: argparse.Namespace, rank: int, conc: int, start_at: float, stop_at: float, q: mp.Queue) -> None:
    import aiohttp

    files = sorted(glob.glob(os.path.join(args.imgs, "*.jpg")))
    mmkw = {"max_pixels": args.max_pixels, "min_pixels": args.min_pixels} if args.max_pixels else {}

    def body(i: int) -> dict:
        return {"model": args.model, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                "mm_processor_kwargs": mmkw,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": "file://" + files[i % len(files)]}},
                    {"type": "text", "text": args.prompt}]}]}

    async def main() -> tuple[int, int, list[float], str, int]:
        ok = failed = prompt_tokens = 0
        done: list[float] = []  # when each answer came back
        first_err = ""
        counter = rank
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=900),
                                         connector=aiohttp.TCPConnector(limit=conc)) as s:
            async def loop() -> None:
                nonlocal ok, failed, first_err, counter, prompt_tokens
                first = True
                while first or time.time() < stop_at:  # every loop sends at least one request
                    first = False
                    i = counter
                    counter += args.procs
                    try:
                        async with s.post(args.url + "/v1/chat/completions", json=body(i)) as r:
                            j = await r.json(content_type=None)
                            if r.status == 200:
                                ok += 1
                                done.append(time.time())
                                prompt_tokens += (j.get("usage") or {}).get("prompt_tokens", 0)
                            else:
                                failed += 1
                                first_err = first_err or str(j)[:300]
                    except Exception as exc:  # noqa: BLE001 - a dropped connection is one failed request
                        failed += 1
                        first_err = first_err or repr(exc)[:300]
            while time.time() < start_at:
                await asyncio.sleep(0.01)
            await asyncio.gather(*[loop() for _ in range(conc)])
        return ok, failed, done, first_err, prompt_tokens

    q.put(asyncio.run(main()))


def warm_up(args: argparse.Namespace) -> None:
    q: mp.Queue = mp.Queue()
    now = time.time()
    p = mp.Process(target=worker, args=(args, 0, 16, now, now + 0.5, q))
    p.start()
    p.join()
    ok, failed, _, err, prompt_tokens = q.get(timeout=600)
    # The prompt's length shows the budget took effect: about the budget's image tokens plus the text's.
    print(f"warm-up: ok {ok} failed {failed} prompt tokens per request {prompt_tokens / max(ok, 1):.0f} {err}",
          flush=True)
    if not ok:  # a server that refuses every request would otherwise be timed for the whole phase
        print("RESULT " + json.dumps(dict(n=0, ok=0, failed=failed, first_error=err,
                                          error="warm-up: every request failed")), flush=True)
        raise SystemExit(1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True)
    ap.add_argument("--imgs", required=True)
    ap.add_argument("--seconds", type=float, default=30)
    ap.add_argument("--procs", type=int, default=6)
    ap.add_argument("--conc", type=int, required=True)  # gpu_bench.py --serve-conc holds the default
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-pixels", type=int, default=0, help="0: the model's default budget (no kwargs).")
    ap.add_argument("--min-pixels", type=int, default=3136)
    ap.add_argument("--prompt", default="Describe this image in detail.")
    ap.add_argument("--window", type=float, default=30.0, help="Length of the first/last rate windows (s).")
    args = ap.parse_args()
    warm_up(args)
    q: mp.Queue = mp.Queue()
    start_at = time.time() + 2.0  # every process starts sending at once
    stop_at = start_at + args.seconds
    ps = [mp.Process(target=worker, args=(args, k, max(1, args.conc // args.procs), start_at, stop_at, q))
          for k in range(args.procs)]
    for p in ps:
        p.start()
    outs = [q.get(timeout=args.seconds + 900) for _ in ps]  # a dead worker ends the run, not hangs it
    for p in ps:
        p.join()
    ok = sum(o[0] for o in outs)
    failed = sum(o[1] for o in outs)
    done = sorted(t for o in outs for t in o[2])
    errs = [o[3] for o in outs if o[3]]
    prompt_tokens = sum(o[4] for o in outs)
    rates = phase_rates(done, start_at, done[-1] if done else time.time(), args.window)
    print("RESULT " + json.dumps(dict(n=ok, ok=ok, failed=failed, **rates, t0=start_at, conc=args.conc,
                                      procs=args.procs, max_pixels=args.max_pixels, max_tokens=args.max_tokens,
                                      url="file", first_error=errs[0] if errs else "",
                                      prompt_tokens_per_request=round(prompt_tokens / max(ok, 1), 1))), flush=True)


if __name__ == "__main__":
    main()

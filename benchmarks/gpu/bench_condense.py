"""Condense on the H200: summaries per second for 10-image documents (128-token descriptions, 128 output tokens) with
the Qwen2.5-VL-7B config and vLLM dummy weights, alone and beside the inference engine on the same GPU, and how much
it slows image descriptions there.

Engines only (no Kafka): what the GPU gives each stage. Arms, each ``--seconds`` long after a warm-up, both engines
loaded in this process (one GPU; the two ``gpu_memory_utilization`` shares add up to less than 1):

    infer      images only: the inference engine (embeds mode) kept full            -> img/s
    condense   documents only: the condense engine kept full                        -> summaries/s, output tok/s
    both       both at once, each kept full                                         -> img/s and summaries/s

``--arms condense --no-infer`` loads the condense engine alone with the whole GPU (``--condense-mem 0.85``): its
figure on a GPU of its own. On a two-GPU machine, the same with CUDA_VISIBLE_DEVICES=1 while ``--arms infer
--no-condense`` runs on CUDA_VISIBLE_DEVICES=0 gives both on their own GPUs side by side (one host).

``--output fixed`` (default): every answer is exactly 128 tokens (ignore_eos, no grammar), the load the question
names. ``--output guided``: the real path, answers constrained to the answer schema by vLLM's guided JSON; their
length is whatever the (random) model writes, reported as mean output tokens.

Usage (device, after the staging in benchmarks/gpu/README.md; ``source scripts/gpu/env.sh`` first):
    python3 benchmarks/gpu/bench_condense.py --imgs /root/imgs --seconds 60 --out $OUT/condense.json
Prints one ``RESULT {json}`` line and writes it to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks.images import exact_size_images  # noqa: E402 - after the path insert

DESCRIPTION = ("A wooden armchair photographed from the front left; the seat cushion is torn along the seam, the "
               "varnish on both armrests is worn through to bare wood, a brass label under the seat reads 1932, and "
               "the back rail shows woodworm holes. ")


class DocumentPrompts:
    """Prompts of documents of ``images_per_doc`` descriptions of exactly ``description_tokens`` tokens. One is built
    through the stage (``Condenser.prompt``); document d's is that one with d's 7-digit number written over the
    first description's, so no two documents share more than the template (vLLM's prefix cache then reuses only
    what a real stream would share) and a prompt costs microseconds, not the stage's milliseconds."""

    def __init__(self, condenser, images_per_doc: int, description_tokens: int):
        from schemas import DocumentResult

        tokenizer = condenser.tokenizer
        texts = []
        for i in range(images_per_doc):
            ids = tokenizer.encode(f"Document 0000000, image {i}: " + DESCRIPTION * 4, add_special_tokens=False)
            texts.append(tokenizer.decode(ids[:description_tokens]))
        images = tuple({"image_index": i, "status": "ok", "source_uri": f"file:///bench/{i}.jpg", "text": t}
                       for i, t in enumerate(texts))
        result = DocumentResult(doc_id="bench", image_count=images_per_doc, succeeded=images_per_doc, failed=0,
                                images=images, metadata={"shelf": "B4"}, completed_at=1.0)
        self.base = condenser.prompt(result).token_ids
        self.encode = lambda text: tokenizer.encode(text, add_special_tokens=False)
        marker = self.encode("0000000")
        self.at = next(i for i in range(len(self.base)) if self.base[i:i + len(marker)] == marker)
        self.width = len(marker)
        assert all(len(self.encode(f"{d:07d}")) == self.width for d in (1, 1234567)), "digits must be one token each"

    def __call__(self, d: int) -> list[int]:
        ids = list(self.base)
        ids[self.at:self.at + self.width] = self.encode(f"{d % 10_000_000:07d}")
        return ids


class Feeder:
    """Keeps an engine at ``in_flight`` requests for as long as it runs; counts what finishes inside the window."""

    def __init__(self, engine, make_request, in_flight: int):
        self.engine, self.make_request, self.in_flight = engine, make_request, in_flight
        self.done = 0
        self.output_tokens = 0
        self.failures: dict[str, int] = {}
        self.counting = False
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self._next = 0

    def _submit(self, count: int) -> None:
        requests = [self.make_request(self._next + i) for i in range(count)]
        self._next += count
        self.engine.submit(requests)

    def _run(self) -> None:
        self._submit(self.in_flight)
        while not self.stop.is_set():
            finished = self.engine.poll(0.05)
            for out in finished:
                if hasattr(out, "error_kind"):
                    self.failures[out.error_kind] = self.failures.get(out.error_kind, 0) + 1
                elif self.counting:
                    self.done += 1
                    self.output_tokens += out.output_tokens
            if finished and not self.stop.is_set():
                self._submit(len(finished))

    def start(self) -> "Feeder":
        self.thread.start()
        return self

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=60)
        deadline = time.monotonic() + 300  # let the engine empty before the next arm
        while self.engine.pending() and time.monotonic() < deadline:
            self.engine.poll(0.5)


def measure(feeders: list[Feeder], warmup_s: float, seconds: float) -> float:
    for f in feeders:
        f.start()
    time.sleep(warmup_s)
    for f in feeders:
        f.counting = True
    started = time.monotonic()
    time.sleep(seconds)
    for f in feeders:
        f.counting = False
    elapsed = time.monotonic() - started
    for f in feeders:
        f.close()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="/tmp/vlmstream-qwen25vl-7b", help="7B config folder (written if absent)")
    parser.add_argument("--imgs", default=None, help="Folder of images for the inference engine")
    parser.add_argument("--arms", default="infer,condense,both")
    parser.add_argument("--no-infer", action="store_true", help="Do not load the inference engine")
    parser.add_argument("--no-condense", action="store_true", help="Do not load the condense engine")
    parser.add_argument("--output", choices=["fixed", "guided"], default="fixed")
    parser.add_argument("--images-per-doc", type=int, default=10)
    parser.add_argument("--description-tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128, help="Output tokens per answer and per description")
    parser.add_argument("--budget", type=int, default=256 * 28 * 28, help="Pixels per image for inference")
    parser.add_argument("--infer-mem", type=float, default=0.5)
    parser.add_argument("--condense-mem", type=float, default=0.35)
    parser.add_argument("--docs-in-flight", type=int, default=512)
    parser.add_argument("--images-in-flight", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=20.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    arms = [a for a in args.arms.split(",") if a]

    from consumers.condense.engine import CondenseRequest
    from consumers.condense.stage import AnswerSchema, Condenser
    from consumers.condense.vllm_engine import VllmCondenseEngine
    from benchmarks.model7b import write_qwen25vl_7b_config
    from vlmstream.config import CondenseSettings, InferSettings

    model = Path(args.model)
    if not (model / "config.json").exists():
        write_qwen25vl_7b_config(model)
    result: dict = {"model": str(model), "output": args.output, "images_per_doc": args.images_per_doc,
                    "description_tokens": args.description_tokens, "max_tokens": args.max_tokens,
                    "seconds": args.seconds, "arms": {}}

    infer_engine = condense_engine = None
    if not args.no_infer:
        from consumers.infer.engine import InferenceRequest
        from consumers.infer.vllm_engine import VllmEngine

        infer_settings = InferSettings(model=str(model), max_new_tokens=args.max_tokens,
                                       gpu_memory_utilization=args.infer_mem, publish_embeddings=False)
        infer_engine = VllmEngine(model, infer_settings, mode="embeds", load_format="dummy", ignore_eos=True)
        images = exact_size_images(args.imgs, 64, args.budget)

        def image_request(i: int):
            im = images[i % len(images)]
            return InferenceRequest(f"img{i}", im, (1, im.shape[0] // 14, im.shape[1] // 14),
                                    infer_settings.prompt, args.max_tokens)

    if not args.no_condense:
        condense_settings = CondenseSettings(model=str(model), max_new_tokens=args.max_tokens,
                                             gpu_memory_utilization=args.condense_mem)
        schema = AnswerSchema.load(None)
        condense_engine = VllmCondenseEngine(model, condense_settings, schema, load_format="dummy")
        if args.output == "fixed":
            v = condense_engine._v
            condense_engine.sampling_params = lambda max_tokens: v.SamplingParams(
                max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                output_kind=v.RequestOutputKind.FINAL_ONLY)
        condenser = Condenser(condense_settings, condense_engine.tokenizer, schema)
        prompts = DocumentPrompts(condenser, args.images_per_doc, args.description_tokens)
        result["prompt_tokens"] = len(prompts.base)

        def doc_request(i: int):  # every request a new document
            return CondenseRequest(f"doc{i}", prompts(i), args.max_tokens)

    try:
        for arm in arms:
            feeders = []
            if arm in ("infer", "both") and infer_engine is not None:
                feeders.append(("infer", Feeder(infer_engine, image_request, args.images_in_flight)))
            if arm in ("condense", "both") and condense_engine is not None:
                feeders.append(("condense", Feeder(condense_engine, doc_request, args.docs_in_flight)))
            if not feeders:
                continue
            elapsed = measure([f for _, f in feeders], args.warmup, args.seconds)
            row = {}
            for name, f in feeders:
                unit = "img_per_s" if name == "infer" else "summaries_per_s"
                row[f"{name}_{unit}"] = round(f.done / elapsed, 3)
                row[f"{name}_output_tok_per_s"] = round(f.output_tokens / elapsed, 1)
                row[f"{name}_mean_output_tokens"] = round(f.output_tokens / f.done, 1) if f.done else None
                if f.failures:
                    row[f"{name}_failures"] = f.failures
            result["arms"][arm] = row
            print("PHASE", arm, json.dumps(row), flush=True)
        a = result["arms"]
        if "both" in a and "infer" in a and a["infer"].get("infer_img_per_s"):
            result["infer_slowdown_beside_condense"] = round(a["both"]["infer_img_per_s"] / a["infer"]["infer_img_per_s"], 3)
        if "both" in a and "condense" in a and a["condense"].get("condense_summaries_per_s"):
            result["condense_beside_infer_over_alone"] = round(
                a["both"]["condense_summaries_per_s"] / a["condense"]["condense_summaries_per_s"], 3)
    finally:
        for engine in (infer_engine, condense_engine):
            if engine is not None:
                engine.close()
    print("RESULT", json.dumps(result), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""What the estimate counts as inference's cost per image: on the CPU the inference process's CPU time over each batch
(the transformers engine reports it), so a sample crowded by busy decoders does not inflate it; on an accelerator
the batch's wall time. Quick: one tiny-model batch on the CPU, no broker."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from consumers.infer.engine import InferenceOutput, InferenceRequest
from consumers.infer.tiny_model import default_tiny_model_dir
from schemas import Description
from tests.helpers import smallest_exact_size_images
from vlmstream.config import InferSettings

pytestmark = pytest.mark.model

MAX_PIXELS = 64 * 28 * 28


@pytest.fixture(scope="module")
def batch_outputs(corpus_dir) -> list[InferenceOutput]:
    """One batch of two corpus images of different sizes through the transformers engine on the CPU."""
    from consumers.infer.transformers_engine import TransformersEngine

    images = smallest_exact_size_images(corpus_dir, 2, MAX_PIXELS)
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with TransformersEngine(default_tiny_model_dir(), InferSettings(batch_size=2), device="cpu") as engine:
            engine.submit([InferenceRequest(f"d{i}/0", im, (1, im.shape[0] // 14, im.shape[1] // 14), "Describe.", 2)
                           for i, im in enumerate(images)])
            out, deadline = [], time.monotonic() + 120
            while len(out) < 2 and time.monotonic() < deadline:
                out += engine.poll(1.0)
    finally:
        torch.set_num_threads(previous)
    assert len(out) == 2 and all(isinstance(o, InferenceOutput) for o in out), out
    return out


def _descriptions(outputs: list[InferenceOutput], wall_times: float = 1.0) -> list[tuple[float, Description]]:
    """The descriptions the runner would write for the outputs; ``wall_times`` multiplies the engine's wall-clock
    timings, as a sample run on crowded cores would see them."""
    rows = []
    for i, out in enumerate(outputs):
        timings = {k: v * wall_times if k in ("vision_ms", "batch_ms", "preprocess_ms", "generate_ms") else v
                   for k, v in out.timings_ms.items()}
        timings["prepare_cpu_ms"] = 5.0
        rows.append((100.0 + i, Description(doc_id=f"d{i}", image_index=0, image_count=1, text=out.text, model="tiny",
                                            prompt_id="p", engine="transformers", source_uri=f"file:///img{i}",
                                            visual_tokens=out.visual_tokens, timings_ms=timings)))
    return rows


def test_inference_costs_the_cpu_time_of_its_batch_on_the_cpu_and_wall_time_elsewhere(batch_outputs):
    from vlmstream.cli.estimate_sample import sample_images
    from vlmstream.projection.costs import calibrate
    from vlmstream.projection.sample import sample_windows

    t = batch_outputs[0].timings_ms
    assert all(o.timings_ms["batch_cpu_ms"] == t["batch_cpu_ms"] for o in batch_outputs)  # one batch, one figure
    assert 0 < t["vision_cpu_ms"] <= t["batch_cpu_ms"]

    classes = {f"file:///img{i}": f"e1/s{i}" for i in range(2)}
    calm = sample_images(_descriptions(batch_outputs), classes, {})
    crowded = sample_images(_descriptions(batch_outputs, wall_times=3.0), classes, {})
    for images in (calm, crowded):
        # The batch's CPU time shared out over its images (by visual tokens for the tower's part): nothing more.
        assert all(im.infer_cpu and im.decode_cpu for im in images)
        assert sum(im.infer_s for im in images) == pytest.approx(t["batch_cpu_ms"] / 1000, rel=1e-9)
        assert images[0].batch_s == images[1].batch_s > 0  # the batch's wall time still marks the timeline
    # A batch that took three times as long on crowded cores costs what it cost the cores.
    assert [im.infer_s for im in crowded] == pytest.approx([im.infer_s for im in calm], rel=1e-9)
    costs = calibrate(crowded, sample_windows(crowded), decode_parallel=2, shared_cores=True, cores=2,
                      infer_threads=1)
    assert costs.infer_cost == "cpu"

    # Without CPU timings (an engine on an accelerator), the batch's wall time is the cost.
    on_gpu = [(at, dataclasses.replace(d, timings_ms={k: v for k, v in d.timings_ms.items()
                                                       if not k.endswith("_cpu_ms")}))
              for at, d in _descriptions(batch_outputs)]
    images = sample_images(on_gpu, classes, {})
    assert not any(im.infer_cpu for im in images)
    assert sum(im.infer_s for im in images) == pytest.approx(t["batch_ms"] / 1000, rel=1e-9)
    assert calibrate(images, sample_windows(images), decode_parallel=2, shared_cores=False).infer_cost == "wall"

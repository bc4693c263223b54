"""infer.tower_ahead's hooks against vLLM's own types, on the CPU, without an engine: where vLLM is installed (the GPU
kit), before a lease spends GPU time on the tower run ahead of the step.

What it runs: requests carrying tagged pixel rows (consumers/infer/pixel_rows.py) made into vLLM's multimodal items
by the Qwen2-VL family's field config (as vLLM's processor makes them from image_embeds), sent through vLLM's
msgpack encoder and decoder (as the engine process receives them), prepared by vLLM's own
``EngineCore.preprocess_add_request`` with our wrapper (each image offered to the ahead encoder, which encodes it on
the CPU with the tiny model's tower), then batched by vLLM's own ``GPUModelRunner._batch_mm_inputs_from_scheduler``
with our wrapper (the tags noted on the host) and ``group_and_batch_mm_kwargs``; each group's grids must pop the
offered tags in order, equal to the tags read from the batched rows, and the ahead encoder must hand over every
image it made.

Usage (PYTHONPATH with vLLM, as scripts/gpu/env.sh sets it): python3 benchmarks/gpu/check_ahead_hooks.py
Prints one RESULT line; exits 1 when a check fails.
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from consumers.infer import engine_tower, pixel_rows  # noqa: E402 - the repository is on sys.path now
from consumers.infer.tiny_model import default_tiny_model_dir  # noqa: E402
from consumers.infer.tower_ahead import AheadEncoder  # noqa: E402
from consumers.infer.vision import VisionEncoder, load_vision_tower  # noqa: E402

GRIDS = ((1, 8, 12), (1, 10, 6), (1, 4, 4))


def engine_requests(family) -> tuple[list, list[int]]:
    """One EngineCoreRequest per image, as vLLM's engine process decodes it, and the images' tags."""
    from transformers import BatchFeature
    from vllm.model_executor.models.qwen2_vl import _create_qwen2vl_field_factory
    from vllm.multimodal.inputs import MultiModalFeatureSpec, MultiModalKwargsItems, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    rng = np.random.default_rng(0)
    requests, tags = [], []
    for n, grid in enumerate(GRIDS):
        image = rng.integers(0, 256, (grid[1] * family.patch_size, grid[2] * family.patch_size, 3), dtype=np.uint8)
        tag = pixel_rows.make_tag(n + 1, keep_embedding=n % 2 == 0)
        rows = pixel_rows.pack(image, grid, family, tag)
        inputs = BatchFeature({"image_embeds": rows, "image_grid_thw": torch.tensor([grid])})
        items = MultiModalKwargsItems.from_hf_inputs(inputs, _create_qwen2vl_field_factory(family.merge_size)(inputs))
        feature = MultiModalFeatureSpec(data=items["image"][0], modality="image", identifier=f"req{n}",
                                        mm_position=PlaceholderRange(offset=3, length=rows.shape[0]))
        request = EngineCoreRequest(request_id=f"req{n}", prompt_token_ids=[1] * (rows.shape[0] + 6),
                                    mm_features=[feature], sampling_params=SamplingParams(max_tokens=4),
                                    pooling_params=None, arrival_time=time.time(), lora_request=None,
                                    cache_salt=None, data_parallel_rank=None)
        requests.append(MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(request)))
        tags.append(tag)
    return requests, tags


def main() -> int:
    from vllm.multimodal.utils import group_and_batch_mm_kwargs
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    tower, _ = load_vision_tower(default_tiny_model_dir(), "cpu", torch.float32)
    encoder = VisionEncoder(tower, "cpu", torch.float32, qkv_kernel="torch")
    ahead = engine_tower.AHEAD = AheadEncoder()
    ahead.attach(encoder)
    checks: dict = {"hooks_installed": engine_tower.install_ahead()}
    requests, tags = engine_requests(encoder.family)

    core = types.SimpleNamespace(mm_receiver_cache=None, request_block_hasher=None, structured_output_manager=None)
    prepared = [EngineCore.preprocess_add_request(core, r)[0] for r in requests]
    deadline = time.monotonic() + 60
    while ahead.report()["encoded"] < len(tags) and time.monotonic() < deadline:
        time.sleep(0.05)
    checks["offered_and_made"] = ahead.report()["encoded"] == len(tags)

    runner = types.SimpleNamespace(requests={r.request_id: r for r in prepared})
    scheduled = types.SimpleNamespace(scheduled_encoder_inputs={r.request_id: [0] for r in prepared})
    _, mm_kwargs, _ = GPUModelRunner._batch_mm_inputs_from_scheduler(runner, scheduled)
    popped, from_rows, taken = [], [], 0
    for _, _, batch in group_and_batch_mm_kwargs(mm_kwargs, device="cpu"):
        grids = [tuple(g) for g in batch["image_grid_thw"].tolist()]
        group_tags = engine_tower.SCHEDULED.pop(grids)
        popped += group_tags or []
        from_rows += pixel_rows.tag_values(pixel_rows.tags(batch["image_embeds"], batch["image_grid_thw"],
                                                           encoder.family))
        taken += sum(o is not None for o in ahead.take(group_tags or []))
    checks["noted_tags_in_order"] = popped == tags
    checks["noted_tags_equal_those_in_the_rows"] = from_rows == tags
    checks["every_image_taken_made_ahead"] = taken == len(tags)
    ok = all(checks.values())
    print("RESULT", json.dumps({"pass": ok, **checks, "ahead": ahead.report()}), flush=True)
    ahead.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Each model family beyond Qwen2.5-VL (Qwen2-VL, Qwen3-VL dense and MoE, Qwen3.5) on its tiny random-weight model: the
registry reads the checkpoint, our tower equals transformers' full model's image features (DeepStack included),
the engine's text equals the model's own ``generate`` on the processor's pixels, and `vlmstream run --model` works
end to end on the real broker; and the generic path (a tiny Gemma 3, which no family module describes) end to end.
Qwen2.5-VL's own versions of these are in test_engines.py and test_cli_run.py."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from consumers.infer.tiny_model import (GENERIC_TILING_TINY, GENERIC_TINY, LLAVA_OV_PINPOINTS, TINY_FAMILIES,
                                        write_tiny_family_model)
from tests.helpers import counting, lively, run_env
from vlmstream.models.registry import family_of

pytestmark = pytest.mark.model

FAMILIES = list(TINY_FAMILIES)  # qwen2-vl, qwen3-vl, qwen3-vl-moe, qwen3.5
# End to end: the families whose decode differs from Qwen2.5-VL's (test_cli_run.py runs that one), and the generic
# path with a fixed resize and with a tiling processor.
END_TO_END = ["qwen3-vl", "qwen3-vl-moe", "qwen3.5", GENERIC_TINY, GENERIC_TILING_TINY]
PROMPT = "Describe this image."


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # The test machine is shared: one OpenMP thread runs the tiny models' small matrices fastest.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-families")
    return {name: write_tiny_family_model(root / name, name)
            for name in [*FAMILIES, GENERIC_TINY, GENERIC_TILING_TINY]}


def _images(factor: int) -> list[np.ndarray]:
    """Two images of different shapes, noise so every patch differs."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (factor * h, factor * w, 3), dtype=np.uint8) for h, w in ((8, 10), (9, 6))]


def test_the_checkpoint_names_its_family_and_its_pixel_limits(tiny_dirs):
    qwen3 = family_of(tiny_dirs["qwen3-vl"])
    assert qwen3.name == "qwen3_vl" and family_of(tiny_dirs["qwen3-vl-moe"]).name == "qwen3_vl"
    assert family_of(tiny_dirs["qwen3.5"]).name == "qwen3_5"
    assert (qwen3.patch_size, qwen3.factor, qwen3.image_mean, qwen3.image_std) == (16, 32, (0.5,) * 3, (0.5,) * 3)
    # The released preprocessor config's size: 64 to 16,384 visual tokens of 32 x 32 pixels.
    assert (qwen3.min_pixels, qwen3.max_pixels, qwen3.max_visual_tokens) == (65_536, 16_777_216, 16_384)
    processor = json.loads((tiny_dirs["qwen3-vl"] / "preprocessor_config.json").read_text())
    processor["size"]["longest_edge"] = 1024 * 32 * 32
    (tiny_dirs["qwen3-vl"] / "preprocessor_config.json").write_text(json.dumps(processor))
    try:
        assert family_of(tiny_dirs["qwen3-vl"]).max_pixels == 1024 * 32 * 32
    finally:
        processor["size"]["longest_edge"] = qwen3.max_pixels
        (tiny_dirs["qwen3-vl"] / "preprocessor_config.json").write_text(json.dumps(processor))


@pytest.mark.parametrize("name", FAMILIES)
def test_our_tower_equals_the_full_models_image_features(tiny_dirs, name):
    """Patchify + tower, both as the full model holds it and loaded alone from the safetensors, against
    transformers' ``get_image_features`` on its own processor's pixels: the main merger's tokens and, for
    Qwen3-VL, every DeepStack level, concatenated as vLLM takes ``image_embeds``."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from consumers.infer.vision.checkpoint import load_vision_tower
    from consumers.infer.vision.encoder import VisionEncoder

    path = tiny_dirs[name]
    family = family_of(path)
    config = json.loads((path / "config.json").read_text())
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    images = _images(family.factor)
    reference = AutoImageProcessor.from_pretrained(path)(images=images, do_resize=False, return_tensors="pt")
    with torch.inference_mode():
        features = model.model.get_image_features(reference["pixel_values"], reference["image_grid_thw"])
    expected = torch.cat(features.pooler_output)
    # transformers gives each DeepStack level split per image, as it gives the main tokens.
    levels = [torch.cat(level) for level in getattr(features, "deepstack_features", None) or []]
    assert len(levels) == len(config["vision_config"].get("deepstack_visual_indexes") or [])
    expected = torch.cat([expected, *levels], -1)
    assert expected.shape[1] == family.image_embeds_width(config["vision_config"])

    tower, real = load_vision_tower(path, "cpu", torch.float32)
    assert real
    for encoder in (VisionEncoder(model.model.visual, "cpu", torch.float32, family=family),
                    VisionEncoder(tower, "cpu", torch.float32)):
        encoded = encoder.encode(images)
        assert [list(e.grid_thw) for e in encoded] == reference["image_grid_thw"].tolist()
        torch.testing.assert_close(torch.cat([e.tokens for e in encoded]), expected, atol=1e-5, rtol=1e-5)
        # The published embedding: the mean of the main merger's tokens, out_hidden_size wide.
        first = encoded[0]
        assert first.mean_pooled().shape == (family.embedding_width(config["vision_config"]),)
        np.testing.assert_allclose(first.mean_pooled().astype(np.float32),
                                   features.pooler_output[0].mean(0).numpy(), atol=2e-3, rtol=2e-3)
        # The vLLM engine's way (launch now, wait later): the same image_embeds and the same embeddings, only for
        # the images asked for.
        tokens, embeddings = encoder.launch(images, True, [1]).wait()
        torch.testing.assert_close(torch.cat(tokens), expected, atol=1e-5, rtol=1e-5)
        assert embeddings[0] is None and np.array_equal(embeddings[1], encoded[1].mean_pooled())
        tokens, embeddings = encoder.launch(images, False, []).wait()
        assert tokens == [None, None] and embeddings == [None, None]


@pytest.mark.parametrize("name", FAMILIES)
def test_the_engine_tower_turns_each_familys_pixel_rows_into_the_full_models_image_features(tiny_dirs, name,
                                                                                            engine_tower_config):
    """Our tower in vLLM's engine process, embeds mode: two decoded images' bytes as pixel rows, concatenated as vLLM batches
    image_embeds, through the patched ``_process_image_input`` give per image what transformers' full model gives
    (merged tokens and, for Qwen3-VL, every DeepStack level), for each family's patch size."""
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    from consumers.infer import engine_tower, pixel_rows
    from consumers.infer.vision.checkpoint import load_vision_tower
    from consumers.infer.vision.encoder import VisionEncoder

    path = tiny_dirs[name]
    engine_tower_config(path)
    family = family_of(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    images = _images(family.factor)
    reference = AutoImageProcessor.from_pretrained(path)(images=images, do_resize=False, return_tensors="pt")
    with torch.inference_mode():
        features = model.model.get_image_features(reference["pixel_values"], reference["image_grid_thw"])
    sizes = (reference["image_grid_thw"].prod(-1) // family.merge_size ** 2).tolist()
    expected = torch.cat([torch.cat(features.pooler_output),
                          *(torch.cat(level) for level in getattr(features, "deepstack_features", None) or [])],
                         -1).split(sizes)

    class VllmModel:  # what the patched method reads of vLLM's model: nothing but this flag, with build given
        use_data_parallel = False

    tower, _ = load_vision_tower(path, "cpu", torch.float32)
    process = engine_tower.through_our_tower(lambda self, image_input: "vLLM's own path",
                                             build=lambda _: VisionEncoder(tower, "cpu", torch.float32))
    rows = torch.cat([pixel_rows.pack(image, tuple(grid), family)
                      for image, grid in zip(images, reference["image_grid_thw"].tolist())])
    got = process(VllmModel(), {"type": "image_embeds", "image_embeds": rows,
                                "image_grid_thw": reference["image_grid_thw"]})
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    # Tagged rows (embeddings published): the same features, and each image's embedding kept in the engine for
    # the consumer is the family's: the mean of the full model's merged tokens, DeepStack left out.
    tags = [31, 32]
    tagged = torch.cat([pixel_rows.pack(image, tuple(grid), family, tag)
                        for image, grid, tag in zip(images, reference["image_grid_thw"].tolist(), tags)])
    got = process(VllmModel(), {"type": "image_embeds", "image_embeds": tagged,
                                "image_grid_thw": reference["image_grid_thw"]})
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5)
    kept = engine_tower.tap().take(tags)
    assert sorted(kept) == tags
    for tag, pooled in zip(tags, features.pooler_output):
        np.testing.assert_allclose(np.frombuffer(kept[tag], dtype=np.float16).astype(np.float32),
                                   pooled.mean(0).numpy(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("name", FAMILIES)
def test_fast_blocks_compute_what_the_towers_own_blocks_compute(tiny_dirs, name, interpreted_triton,
                                                                interpreted_mlp_kernels, interpreted_norm_kernels):
    """Each family's LayerNorm tower with our fused blocks against the same tower running transformers' blocks, on
    three images of different sizes in one forward, DeepStack levels included: as the encoder installs them (the
    tiny MLP width 128 is already aligned), with the MLP padded (alignment 48 pads 128 to 144), and with the Triton
    kernels (Triton's interpreter on the CPU): q/k/v split and rotated by one (v left in the projection, then
    written out), the MLP's activation by another and the LayerNorms by the norm kernels, in every block."""
    from benchmarks.reference_tower import TransformersBlocksEncoder
    from consumers.infer.vision.blocks import FastVisionBlocks
    from consumers.infer.vision.checkpoint import load_vision_tower
    from consumers.infer.vision.encoder import VisionEncoder
    from consumers.infer.vision.pixels import patchify_batch

    family = family_of(tiny_dirs[name])
    tower = lively(load_vision_tower(tiny_dirs[name], "cpu", torch.float32)[0])
    keys = set(tower.state_dict())
    images = [*_images(family.factor), np.full((family.factor * 4, family.factor * 12, 3), 90, np.uint8)]
    pixel_values, grid_thw = patchify_batch(images, family=family)
    reference = TransformersBlocksEncoder(tower, "cpu", torch.float32, attention="sdpa")
    assert not any("forward" in vars(block) for block in tower.blocks)
    expected = torch.cat(reference.encode_patches(pixel_values, grid_thw))
    assert expected.shape[1] == reference.image_embeds_width  # the DeepStack levels are in what is compared

    encoder = VisionEncoder(tower, "cpu", torch.float32, attention="sdpa")
    assert encoder.fast is not None and encoder.fast.replaced == len(tower.blocks)
    torch.testing.assert_close(torch.cat(encoder.encode_patches(pixel_values, grid_thw)), expected,
                               atol=1e-5, rtol=1e-4)
    FastVisionBlocks(tower, attention=None, alignment=48)
    assert all(block._vlmstream_mlp[1][0].shape[0] == 144 for block in tower.blocks)
    torch.testing.assert_close(torch.cat(encoder.encode_patches(pixel_values, grid_thw)), expected,
                               atol=1e-5, rtol=1e-4)
    assert FastVisionBlocks(tower, attention=None, alignment=48, triton=True, strided_v=True).strided_v
    torch.testing.assert_close(torch.cat(encoder.encode_patches(pixel_values, grid_thw)), expected,
                               atol=1e-5, rtol=1e-4)
    blocks = FastVisionBlocks(tower, attention=None, alignment=48, triton=True)
    calls = {"qkv": [], "norm": [], "mlp": []}
    blocks.rotate_qkv = counting(blocks.rotate_qkv, calls["qkv"])
    blocks.mlp_kernels = {activation: counting(kernel, calls["mlp"]) for activation, kernel in blocks.mlp_kernels.items()}
    for kernel in ("norm", "add_norm"):
        setattr(blocks.norm_kernels, kernel, counting(getattr(blocks.norm_kernels, kernel), calls["norm"]))
    torch.testing.assert_close(torch.cat(encoder.encode_patches(pixel_values, grid_thw)), expected,
                               atol=1e-5, rtol=1e-4)
    # One forward for all three images: every block's q/k/v and MLP through a kernel, both its norms through theirs.
    assert {kind: len(c) for kind, c in calls.items()} == {
        "qkv": len(tower.blocks), "norm": 2 * len(tower.blocks), "mlp": len(tower.blocks)}
    assert set(tower.state_dict()) == keys  # checkpoints still load



def test_a_block_the_fast_path_does_not_know_keeps_transformers_forward(tiny_dirs):
    """A block whose MLP activation is not one the fused forward computes runs transformers' forward; the others
    still run the fused one, and the tower's output is unchanged. An activation with act(0) != 0 gets no padding."""
    from consumers.infer.vision.block_shapes import padded_mlp
    from consumers.infer.vision.blocks import FastVisionBlocks
    from benchmarks.reference_tower import TransformersBlocksEncoder
    from consumers.infer.vision.checkpoint import load_vision_tower
    from consumers.infer.vision.pixels import patchify_batch

    family = family_of(tiny_dirs["qwen3-vl"])
    tower = lively(load_vision_tower(tiny_dirs["qwen3-vl"], "cpu", torch.float32)[0])
    tower.blocks[1].mlp.act_fn = torch.nn.Tanh()
    pixel_values, grid_thw = patchify_batch(_images(family.factor), family=family)
    expected = torch.cat(TransformersBlocksEncoder(tower, "cpu", torch.float32).encode_patches(
        pixel_values, grid_thw))
    blocks = FastVisionBlocks(tower, attention=None, alignment=48)
    assert blocks.replaced == len(tower.blocks) - 1 and "forward" not in vars(tower.blocks[1])
    with torch.inference_mode():
        out = tower(pixel_values, grid_thw=grid_thw)
    got = torch.cat([out.pooler_output, *out.deepstack_features], -1)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)

    mlp = tower.blocks[0].mlp
    padded = padded_mlp(mlp.linear_fc1, mlp.linear_fc2, torch.nn.functional.gelu, alignment=48)
    assert padded[0].shape[0] == 144 and padded[2].shape[1] == 144
    unpadded = padded_mlp(mlp.linear_fc1, mlp.linear_fc2, torch.sigmoid, alignment=48)  # sigmoid(0) = 0.5
    assert all(a is b for a, b in zip(unpadded, (mlp.linear_fc1.weight, mlp.linear_fc1.bias, mlp.linear_fc2.weight),
                                      strict=True))


@pytest.mark.parametrize("name", FAMILIES)
def test_the_engine_says_what_the_model_says_on_its_own_processors_pixels(tiny_dirs, name):
    """The engine hands the model its tower output (DeepStack levels to the first layers); the text must be what
    the model generates when it runs its own tower on its own processor's pixels."""
    from transformers import AutoImageProcessor

    from consumers.infer.engine import InferenceOutput, InferenceRequest
    from consumers.infer.transformers_engine import TransformersEngine
    from vlmstream.config import InferSettings

    path = tiny_dirs[name]
    family = family_of(path)
    engine = TransformersEngine(path, InferSettings(model=str(path), max_new_tokens=6, batch_size=4))
    try:
        images = _images(family.factor)
        requests = [InferenceRequest(f"r{i}", image, family.grid_thw(*image.shape[:2]), PROMPT, 6, True)
                    for i, image in enumerate(images)]
        engine.submit(requests)
        results: dict = {}
        deadline = time.monotonic() + 120
        while len(results) < len(requests) and time.monotonic() < deadline:
            results.update((r.request_id, r) for r in engine.poll(1.0))
        processor = AutoImageProcessor.from_pretrained(path)
        before, after = engine._prompt_parts(PROMPT)
        for request in requests:
            out = results[request.request_id]
            assert isinstance(out, InferenceOutput), out
            assert out.visual_tokens == family.visual_tokens(request.grid_thw)
            assert out.embedding.shape == (engine.model.config.text_config.hidden_size,)
            ids = torch.tensor([before + [engine.image_token_id] * out.visual_tokens + after])
            pixels = processor(images=[request.image], do_resize=False, return_tensors="pt")
            with torch.inference_mode():
                sequence = engine.model.generate(
                    input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels["pixel_values"],
                    image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=(ids == engine.image_token_id).int(),
                    generation_config=engine.generation_config, max_new_tokens=6)
            tokens = engine._trim(sequence[0, ids.shape[1]:].tolist(), 6)
            assert out.text == engine.tokenizer.decode(tokens, skip_special_tokens=True)
            assert out.output_tokens == len(tokens)
    finally:
        engine.close()


def test_tiny_model_cli_writes_each_family(tmp_path):
    from typer.testing import CliRunner

    from vlmstream.cli.main import app

    result = CliRunner().invoke(app, ["tiny-model", str(tmp_path / "q"), "--family", "qwen3-vl"])
    assert result.exit_code == 0, result.output
    assert family_of(tmp_path / "q").name == "qwen3_vl"
    refused = CliRunner().invoke(app, ["tiny-model", str(tmp_path / "x"), "--family", "llava"])
    assert refused.exit_code != 0 and "qwen3-vl" in refused.output


def test_the_generic_path_caps_at_what_the_processor_keeps(tiny_dirs):
    """A model no family describes (Gemma 3) gets the generic path: decode never ships more than its processor's
    own resize keeps (224 x 224 here, each axis capped on its own since that resize ignores the aspect ratio),
    never enlarges, and the user's budget still bounds the area."""
    from vlmstream.models.generic import processor_cap

    family = family_of(tiny_dirs[GENERIC_TINY])
    assert family.name == "generic" and not family.exact_size
    assert family.target_size(3000, 1000, max_pixels=10**9) == (224, 224)
    assert family.target_size(100, 3000, max_pixels=10**9) == (100, 224)
    assert family.target_size(90, 60, max_pixels=10**9) == (90, 60)
    assert family.target_size(3000, 1000, max_pixels=100 * 100) == (100, 100)
    # Idefics3/SmolVLM's longest edge keeps the aspect ratio.
    assert processor_cap({"image_processor_type": "Idefics3ImageProcessorFast",
                          "size": {"longest_edge": 1456}})(3000, 1500, 1, 1, 10**9) == (1456, 728)
    # Tiles of a scheme the rule does not model (Mllama's, Gemma 3's pan and scan, Idefics2's split of the whole
    # image): the image keeps its size, the budget alone bounds it.
    for tiling in ({"max_image_tiles": 4}, {"do_pan_and_scan": True}, {"do_image_splitting": True}):
        config = {"image_processor_type": "Gemma3ImageProcessor", "size": {"height": 560, "width": 560}, **tiling}
        assert processor_cap(config)(3000, 1000, 1, 1, 10**9) == (3000, 1000)
        assert processor_cap(config)(3000, 1000, 1, 1, 30_000) == (300, 100)


def test_image_processor_settings_are_read_where_transformers_reads_them(tiny_dirs, tmp_path):
    """transformers 5 saves a processor's image settings inside processor_config.json (``image_processor``) and
    writes no preprocessor_config.json; transformers and vLLM read that entry first. A checkpoint saved so still gets
    the generic path (it used to be refused as no family) and a family's pixel limits come from that entry."""
    import json
    import shutil

    from transformers import AutoImageProcessor
    from transformers.image_processing_utils import select_best_resolution

    tiling = tiny_dirs[GENERIC_TILING_TINY]
    assert not (tiling / "preprocessor_config.json").exists()
    family = family_of(tiling)
    assert family.name == "generic" and not family.exact_size
    processor = AutoImageProcessor.from_pretrained(tiling)
    assert processor.image_grid_pinpoints == LLAVA_OV_PINPOINTS
    for height, width in [(3000, 5000), (5000, 800), (400, 400)]:
        cap = family.target_size(height, width, max_pixels=10**9)
        assert cap[0] < height and cap[1] < width  # capped by the tiles' rule, not shipped whole
        assert select_best_resolution(cap, LLAVA_OV_PINPOINTS) == select_best_resolution((height, width),
                                                                                           LLAVA_OV_PINPOINTS)
    # A family's limits from the nested entry, which wins over a preprocessor_config.json as in transformers.
    qwen = shutil.copytree(tiny_dirs["qwen3-vl"], tmp_path / "qwen3-vl")
    settings = json.loads((qwen / "preprocessor_config.json").read_text())
    nested = {**settings, "size": {"shortest_edge": 64 * 32 * 32, "longest_edge": 256 * 32 * 32}}
    (qwen / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor",
                                                            "image_processor": nested}))
    limits = family_of(qwen)
    assert (limits.min_pixels, limits.max_pixels) == (64 * 32 * 32, 256 * 32 * 32)
    assert AutoImageProcessor.from_pretrained(qwen).size["longest_edge"] == 256 * 32 * 32


def test_internvls_original_checkpoints_are_capped_by_the_tiles_their_config_sets():
    """An InternVL checkpoint in its original layout (``internvl_chat``) sets its tiles in config.json and a plain
    448-px size in its preprocessor config; vLLM tiles by config.json. The cap follows config.json: a 3000 x 5000 photo
    keeps the aspect ratio and the grid transformers' rule picks for it, not 448 x 448."""
    from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas

    from vlmstream.models.generic import generic_family

    config = {"model_type": "internvl_chat", "architectures": ["InternVLChatModel"], "force_image_size": 448,
              "vision_config": {"image_size": 448}, "min_dynamic_patch": 1, "max_dynamic_patch": 12,
              "dynamic_image_size": True, "use_thumbnail": True}
    family = generic_family(config, {"size": 448, "crop_size": 448, "image_mean": [0.485, 0.456, 0.406]})
    height, width = family.target_size(3000, 5000, max_pixels=10**9)
    columns, rows = get_optimal_tiled_canvas((3000, 5000), (448, 448), 1, 12)
    assert get_optimal_tiled_canvas((height, width), (448, 448), 1, 12) == (columns, rows)
    assert height >= 448 * rows and width >= 448 * columns and abs(width / height - 5000 / 3000) < 0.01
    fixed = generic_family({**config, "dynamic_image_size": False}, {"size": 448})
    assert fixed.target_size(3000, 5000, max_pixels=10**9) == (448, 747)  # one tile: aspect kept, 448 a side


GENERIC_PROCESSORS = {  # name: (transformers class, its keywords as a checkpoint's preprocessor_config.json sets them)
    "llava-onevision": ("LlavaOnevisionImageProcessor", {}),
    "internvl": ("GotOcr2ImageProcessor", {"crop_to_patches": True, "min_patches": 1, "max_patches": 12,
                                           "size": {"height": 448, "width": 448}}),
    "idefics3": ("Idefics3ImageProcessor", {}),
    "gemma3": ("Gemma3ImageProcessor", {"size": {"height": 896, "width": 896}}),
}


@pytest.mark.parametrize("name", sorted(GENERIC_PROCESSORS))
def test_the_generic_cap_leaves_the_processor_the_same_choices_and_pixels(name, corpus_dir):
    """What decode ships on the generic path, processed by the model's own image processor, gives what the whole
    image gives: the same tiles (LLaVA-OneVision's best resolution, InternVL's grid, Idefics3's splits), pixels
    within resampling noise (one uint8 level on average). A tiling processor's choice follows the aspect ratio, so the cap keeps it (4000 x 900
    is a tie between two InternVL grids that a pixel of rounding breaks); a plain fixed-size resize is capped per
    axis. Shapes over whole and tall, wide, square and small images; then the choices alone over many sizes."""
    import random

    import transformers
    from PIL import Image
    from transformers.image_processing_utils import select_best_resolution
    from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas

    from vlmstream.models.generic import processor_cap

    class_name, keywords = GENERIC_PROCESSORS[name]
    processor = getattr(transformers, class_name)(**keywords)
    config = {"image_processor_type": class_name, **keywords, **({"size": {"height": 384, "width": 384},
                              "image_grid_pinpoints": processor.image_grid_pinpoints} if name == "llava-onevision"
                             else {"size": {"longest_edge": 1456}} if name == "idefics3" else {})}
    rule = processor_cap(config)
    source = Image.open(next(p for p in sorted(corpus_dir.rglob("*")) if p.suffix.lower() in (".jpg", ".png")))
    source = source.convert("RGB")
    shrunk = 0
    for height, width in [(3000, 5000), (4000, 900), (2000, 2000), (1600, 2560), (500, 700)]:
        image = np.asarray(source.resize((width, height)))
        cap_h, cap_w = rule(height, width, 1, 1, 10**12)
        assert cap_h <= height and cap_w <= width
        shrunk += (cap_h, cap_w) != (height, width)
        shipped = np.asarray(Image.fromarray(image).resize((cap_w, cap_h), Image.BICUBIC))
        whole = processor(images=[image], return_tensors="pt")["pixel_values"]
        capped = processor(images=[shipped], return_tensors="pt")["pixel_values"]
        assert capped.shape == whole.shape, (height, width, cap_h, cap_w)
        # Resampling twice against once: within one uint8 level on average, in the processor's normalised units.
        assert (capped - whole).abs().mean() < 1 / (255 * min(processor.image_std)), (height, width)
    assert shrunk >= 3  # the cap does cut: not a pass by shipping everything whole

    rng = random.Random(0)
    for _ in range(2000):
        height, width = rng.randint(20, 9000), rng.randint(20, 9000)
        cap_h, cap_w = rule(height, width, 1, 1, 10**12)
        if name == "llava-onevision":
            pins = config["image_grid_pinpoints"]
            assert select_best_resolution((cap_h, cap_w), pins) == select_best_resolution((height, width), pins)
        elif name == "internvl":
            grid = get_optimal_tiled_canvas((height, width), (448, 448), 1, 12)
            assert get_optimal_tiled_canvas((cap_h, cap_w), (448, 448), 1, 12) == grid
            assert (cap_h >= 448 * grid[1] or cap_h == height) and (cap_w >= 448 * grid[0] or cap_w == width)



def test_every_image_text_processor_of_transformers_gets_the_same_tensors_from_what_decode_ships():
    """Generality: for every image processor transformers 5.17 has for an image-text model, at its own defaults,
    decode's copy is processed into the same tensors as the whole image (shapes equal, pixels within resampling
    noise) wherever the cap cuts. A class whose resize the cap does not model keeps the image's size: reading its
    ``size`` as a plain resize would distort Janus's and DeepSeek-VL's padded squares and Fuyu's canvas, change
    Cohere2Vision's tiles and shrink GLM-5's images to 1 x 1. LLaVA-NeXT/OneVision report the size they saw
    (``image_sizes``), which the README states."""
    import warnings

    import transformers
    from PIL import Image
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from vlmstream.models.generic import MODELLED, processor_cap, processor_class

    names = sorted({classes.get("torchvision") or classes.get("pil")
                    for model_type, classes in IMAGE_PROCESSOR_MAPPING_NAMES.items()
                    if model_type in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES and isinstance(classes, dict)} - {None})
    assert len(names) > 40
    texture = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    cut_by: set[str] = set()
    failures = []
    for name in names:
        cls = getattr(transformers, name, None)
        if cls is None:
            continue
        try:
            processor = cls()
        except Exception:  # a class that needs an optional library this install lacks
            continue
        settings = processor.to_dict()
        rule = processor_cap(settings)
        for height, width in [(2000, 3000), (3000, 700), (1200, 1200), (300, 500)]:
            shipped_size = rule(height, width, 1, 1, 10**12)
            assert shipped_size[0] <= height and shipped_size[1] <= width, name
            if shipped_size == (height, width):
                continue
            cut_by.add(processor_class(settings))
            whole = np.asarray(Image.fromarray(texture).resize((width, height), Image.BICUBIC))
            shipped = np.asarray(Image.fromarray(whole).resize(shipped_size[::-1], Image.BICUBIC))
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                a, b = (processor(images=[image], return_tensors="np") for image in (whole, shipped))
            a, b = ({"pixel_values": x} if isinstance(x, np.ndarray) else dict(x) for x in (a, b))
            for key in a:
                if key == "image_sizes" and settings.get("image_grid_pinpoints") is not None:
                    continue
                if np.shape(a[key]) != np.shape(b[key]):
                    failures.append(f"{name} {height}x{width} -> {shipped_size}: {key} {np.shape(a[key])} "
                                    f"against {np.shape(b[key])}")
                elif key == "pixel_values":
                    # Resampling twice against once, on a texture with detail at every scale: two uint8 levels on
                    # average in normalised units (std 0.25 at the least); a distorted image is off by ~0.8.
                    difference = float(np.abs(np.asarray(a[key], np.float32) - np.asarray(b[key], np.float32)).mean())
                    if difference > 2 / 255 / 0.25:
                        failures.append(f"{name} {height}x{width} -> {shipped_size}: pixels off by {difference:.3f}")
    assert not failures, failures
    # Every class the cap models cuts somewhere at its defaults (GotOcr2 tiles only with crop_to_patches: above).
    assert MODELLED - {"GotOcr2ImageProcessor"} <= cut_by, MODELLED - cut_by


def test_the_generic_engine_describes_any_size_and_refuses_what_is_no_rgb_image(tiny_dirs):
    """The transformers engine of the generic path takes an RGB image of any size (its processor resizes) and
    turns anything else into an invalid_request failure that says what it needs, without failing the batch."""
    from consumers.infer.engine import InferenceFailure, InferenceOutput, InferenceRequest
    from consumers.infer.processor_engine import ProcessorEngine
    from vlmstream.config import InferSettings

    path = tiny_dirs[GENERIC_TINY]
    engine = ProcessorEngine(path, InferSettings(model=str(path), max_new_tokens=3, batch_size=4), family_of(path))
    try:
        rgb = np.random.default_rng(0).integers(0, 256, (37, 61, 3), dtype=np.uint8)
        engine.submit([InferenceRequest("good", rgb, (1, 1, 1), PROMPT, 3, False),
                       InferenceRequest("grey", rgb[..., 0], (1, 1, 1), PROMPT, 3, False),
                       InferenceRequest("float", rgb.astype(np.float32), (1, 1, 1), PROMPT, 3, False)])
        results: dict = {}
        deadline = time.monotonic() + 120
        while len(results) < 3 and time.monotonic() < deadline:
            results.update((r.request_id, r) for r in engine.poll(1.0))
    finally:
        engine.close()
    assert isinstance(results["good"], InferenceOutput) and results["good"].output_tokens > 0
    for bad in ("grey", "float"):
        failure = results[bad]
        assert isinstance(failure, InferenceFailure) and failure.error_kind == "invalid_request" and not failure.retriable
        assert "H x W x 3 uint8" in failure.detail


def test_the_generic_prompt_is_the_models_own_chat_template(tiny_dirs):
    """vLLM's engine on the generic path prompts with the checkpoint's chat template, whose image marker (Gemma 3's
    <start_of_image>) the model's processor expands; a family's built-in Qwen prompt would carry no image there."""
    from transformers import AutoTokenizer

    from consumers.infer.prompts import PromptBuilder

    folder = tiny_dirs[GENERIC_TINY]
    prompt = PromptBuilder(AutoTokenizer.from_pretrained(folder), family_of(folder)).prompt("Describe it.")
    assert prompt.count("<start_of_image>") == 1 and "Describe it." in prompt and "<|image_pad|>" not in prompt
    with pytest.raises(ValueError, match="chat template.*infer.model"):
        PromptBuilder(None, family_of(folder)).prompt("Describe it.")


def test_a_decode_model_that_is_no_checkpoint_is_refused_with_the_settings_name(tmp_path):
    import pydantic

    from vlmstream.config import DecodeSettings

    with pytest.raises(pydantic.ValidationError, match="(?s)model.*has no config.json.*decode.model"):
        DecodeSettings(model=str(tmp_path / "missing"))


def test_a_text_only_model_is_no_family_and_no_generic_model(tmp_path):
    from vlmstream.models.registry import UnknownModelFamily

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(UnknownModelFamily, match="'llama'"):
        family_of(tmp_path)


def test_a_model_the_engine_cannot_load_fails_at_start_naming_the_setting(tmp_path):
    from consumers.infer.engine import EngineCannotLoadModel
    from consumers.infer.factory import make_engine
    from benchmarks.model7b import write_qwen3vl_8b_config
    from vlmstream.config import InferSettings

    folder = write_qwen3vl_8b_config(tmp_path / "weightless")  # a config, no weights
    with pytest.raises(EngineCannotLoadModel, match="infer.model"):
        make_engine(InferSettings(model=str(folder), engine="transformers"))


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.parametrize("name", END_TO_END)
def test_run_with_each_tiny_model_end_to_end(tiny_dirs, name, topic_names, corpus_dir, tmp_path, unique):
    """`vlmstream run --model PATH` on the real broker: decode resizes for the checkpoint's family (32 px blocks;
    for the generic path, no larger than the processor keeps), one description per image, one result per document,
    embeddings of the family's width (none on the generic path)."""
    from schemas import Description, DocumentResult, Embedding
    from schemas.messages import decode_image_payload
    from tests.kafka_helpers import read_topic

    images = sorted(p for p in corpus_dir.rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))[:3]
    layout = {"doc-a": images[:2], "doc-b": images[2:3] or images[:1]}
    folder = tmp_path / "docs"
    for doc, files in layout.items():
        (folder / doc).mkdir(parents=True)
        for index, path in enumerate(files):
            (folder / doc / f"{index:02d}{path.suffix.lower()}").write_bytes(path.read_bytes())
    t = topic_names.topics
    env = run_env(topic_names, tmp_path, f"fam-{unique}", 2)
    path = tiny_dirs[name]
    run = subprocess.run([sys.executable, "-m", "vlmstream.cli", "run", str(folder), "--model", str(path),
                          "--decode-workers", "1", "--max-pixels", str(128 * 32 * 32), "--max-new-tokens", "4",
                          "--timeout-s", "300"], env=env, capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-4000:]
    assert f"model family: {family_of(path).name}" in " ".join(run.stderr.split())

    expected = {doc: len(files) for doc, files in layout.items()}
    results = {DocumentResult.decode(r.value).doc_id: DocumentResult.decode(r.value)
               for r in read_topic(topic_names, t.results, expected=len(expected), timeout_s=60)}
    assert set(results) == set(expected)
    for doc, count in expected.items():
        assert (results[doc].image_count, results[doc].succeeded) == (count, count), results[doc]
    descriptions = [Description.decode(r.value) for r in read_topic(topic_names, t.descriptions, timeout_s=30)]
    assert Counter((d.doc_id, d.image_index) for d in descriptions) == Counter(
        {(doc, i): 1 for doc, count in expected.items() for i in range(count)})
    family = family_of(path)
    if not family.exact_size:
        for record in read_topic(topic_names, t.images, expected=sum(expected.values()), timeout_s=30):
            meta = decode_image_payload(record.headers)
            if name == GENERIC_TINY:
                assert meta.width <= 224 and meta.height <= 224, meta  # the processor's 224 x 224
                continue
            # LLaVA-OneVision: the tiles' cap of the (oriented) image within the run's budget, smaller than it.
            caps = {family.target_size(h, w, max_pixels=meta.max_pixels)
                    for h, w in ((meta.orig_height, meta.orig_width), (meta.orig_width, meta.orig_height))}
            assert (meta.height, meta.width) in caps and meta.height * meta.width < meta.orig_height * meta.orig_width
        assert not read_topic(topic_names, t.embeddings, timeout_s=5, idle_s=1)
        return
    embeddings = [Embedding.decode(r.value) for r in read_topic(topic_names, t.embeddings, timeout_s=30)]
    width = family.embedding_width(json.loads((path / "config.json").read_text())["vision_config"])
    assert len(embeddings) == sum(expected.values())
    for embedding in embeddings:
        assert embedding.dim == width and len(base64.b64decode(embedding.vector_b64)) == width * 2  # float16
        # Within the budget in the family's 16 px patches. (Had decode resized to Qwen2-VL's 28 px blocks, the
        # engine would have refused every image as no multiple of 32 px, and no result would have succeeded.)
        _, rows, columns = embedding.grid_thw
        assert rows * columns * 16 * 16 <= 128 * 32 * 32


@pytest.mark.parametrize("name", ["qwen2.5-vl-7b", "qwen3-vl-8b", "qwen3-vl-30b-a3b", "qwen3.5-397b-a17b",
                                  "qwen3.5-27b", "gemma3-4b", "llava-onevision-7b"])
def test_each_gpu_models_config_builds_the_model_it_names(tmp_path, name):
    """The released configs the GPU benchmarks run with dummy weights (benchmarks/model7b.py): transformers
    builds each (on the meta device: no memory), the registry finds its family, and a family's tower makes
    image_embeds of the width vLLM's model takes (the language model's, times 1 + DeepStack levels)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from benchmarks.model7b import GPU_MODELS

    folder = GPU_MODELS[name](tmp_path / name)
    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    family = family_of(folder)
    if not family.exact_size:
        assert (name, type(model).__name__) in {("gemma3-4b", "Gemma3ForConditionalGeneration"),
                                                ("llava-onevision-7b", "LlavaOnevisionForConditionalGeneration")}
        assert sum(p.numel() for p in model.parameters()) > 3e9  # the released sizes, not a tiny model
        return
    vision = config.vision_config.to_dict()
    levels = len(vision.get("deepstack_visual_indexes") or ())
    assert family.image_embeds_width(vision) == config.text_config.hidden_size * (1 + levels)
    assert sum(p.numel() for p in model.model.visual.parameters()) > 1e8  # the released tower, not a tiny one

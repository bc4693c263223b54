"""Inference engines on CPU with the tiny model and real corpus images (no mocks): device-side patchify
against transformers' processor, the transformers engine's text + embedding from one vision pass,
batching without a barrier, schema violations as values, and vLLM's absence reported clearly."""

from __future__ import annotations

import importlib
import json
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from consumers.infer.engine import EngineDeadError, InferenceFailure, InferenceOutput, InferenceRequest
from consumers.infer.prompts import OutputSchema, OutputSchemaViolation
from consumers.infer.tiny_model import default_tiny_model_dir
from tests.helpers import counting, lively, smallest_exact_size_images
from vlmstream.config import InferSettings

pytestmark = pytest.mark.model

# Small budgets keep the CPU run short: <= 64 visual tokens per image.
MAX_PIXELS = 64 * 28 * 28
PROMPT = "Describe this image in one sentence."


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # The test machine is shared: two OpenMP threads spinning against other processes run ~10x slower
    # than one thread on the tiny model's small matrices.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return default_tiny_model_dir()


@pytest.fixture(scope="module")
def images(corpus_dir) -> list[np.ndarray]:
    """Real corpus images at their exact smart_resize size, as the decode stage hands them over."""
    out = smallest_exact_size_images(corpus_dir, 5, MAX_PIXELS)
    assert len({im.shape for im in out}) > 1, "want images of different sizes in one batch"
    return out


def _request(i: int, image: np.ndarray, max_new_tokens: int = 6, **kw) -> InferenceRequest:
    return InferenceRequest(f"doc{i}/0", image, (1, image.shape[0] // 14, image.shape[1] // 14), PROMPT,
                            max_new_tokens, **kw)


def _collect(engine, n: int, timeout_s: float = 120.0) -> list[list]:
    """Every poll's answer until n results arrived (the list of lists shows how they trickled in)."""
    polls, total, deadline = [], 0, time.monotonic() + timeout_s
    while total < n:
        assert time.monotonic() < deadline, f"only {total} of {n} results after {timeout_s}s"
        got = engine.poll(1.0)
        if got:
            polls.append(got)
            total += len(got)
    return polls


@pytest.fixture(scope="module")
def engine(model_dir):
    from consumers.infer.transformers_engine import TransformersEngine

    with TransformersEngine(model_dir, InferSettings(batch_size=8), device="cpu") as eng:
        yield eng


def test_patchify_matches_the_processor(images, model_dir):
    from transformers import AutoImageProcessor

    from consumers.infer.vision.pixels import patchify_batch

    processor = AutoImageProcessor.from_pretrained(model_dir)
    expected = processor(images=images, do_resize=False, return_tensors="pt")
    pixel_values, grid_thw = patchify_batch(images)
    assert torch.equal(grid_thw, expected["image_grid_thw"])
    assert pixel_values.shape == expected["pixel_values"].shape
    torch.testing.assert_close(pixel_values, expected["pixel_values"], atol=1e-5, rtol=1e-5)


def test_linear_patch_embedding_equals_the_convolution_it_replaces(images, model_dir):
    from consumers.infer.vision.checkpoint import load_vision_tower
    from consumers.infer.vision.encoder import PatchProjection, use_linear_patch_embedding
    from consumers.infer.vision.pixels import patchify_batch

    convolution, _ = load_vision_tower(model_dir, "cpu", torch.float32)
    linear, _ = load_vision_tower(model_dir, "cpu", torch.float32)
    keys_before = {k: v.shape for k, v in linear.state_dict().items()}
    use_linear_patch_embedding(linear)
    assert isinstance(linear.patch_embed.proj, PatchProjection)
    assert {k: v.shape for k, v in linear.state_dict().items()} == keys_before  # checkpoints still load
    pixel_values, grid_thw = patchify_batch(images[:3])
    with torch.inference_mode():
        expected = convolution(pixel_values, grid_thw=grid_thw).pooler_output
        got = linear(pixel_values, grid_thw=grid_thw).pooler_output
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert use_linear_patch_embedding(linear).patch_embed.proj is linear.patch_embed.proj  # idempotent


def test_fast_vision_blocks_compute_what_transformers_blocks_compute(images, model_dir):
    from benchmarks.reference_tower import TransformersBlocksEncoder
    from consumers.infer.vision.blocks import FastVisionBlocks
    from consumers.infer.vision.checkpoint import load_vision_tower
    from consumers.infer.vision.encoder import VisionEncoder
    from consumers.infer.vision.pixels import patchify_batch

    tower, _ = load_vision_tower(model_dir, "cpu", torch.float32)
    keys = set(tower.state_dict())
    pixel_values, grid_thw = patchify_batch(images[:3])
    with torch.inference_mode():
        expected = tower(pixel_values, grid_thw=grid_thw).pooler_output
        # Alignment 48 pads the tiny tower's MLP width (128) to 144: the zero padding must change nothing.
        FastVisionBlocks(tower, attention=None, alignment=48)
        assert all(block._vlmstream_mlp[1][0].shape[0] == 2 * 144 for block in tower.blocks)
        got = tower(pixel_values, grid_thw=grid_thw).pooler_output
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert set(tower.state_dict()) == keys  # checkpoints still load

    # The encoder installs them; the reference encoder gives the same tower's blocks transformers' forward back.
    TransformersBlocksEncoder(tower, "cpu", torch.float32, attention="sdpa")
    assert not any("forward" in vars(block) for block in tower.blocks)
    encoder = VisionEncoder(tower, "cpu", torch.float32, attention="sdpa")
    assert encoder.fast is not None and all("forward" in vars(block) for block in tower.blocks)
    for g, e in zip(encoder.encode_patches(pixel_values, grid_thw), expected.split(
            (grid_thw.prod(-1) // 4).tolist()), strict=True):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)


def test_compiled_vision_blocks_compile_in_this_process(model_dir, monkeypatch):
    """Every function the fast blocks compile asks Inductor to compile in this process: a pool of compile workers
    starting beside the tower held the host's cores and slowed the tower threefold (blocks.IN_PROCESS_COMPILE)."""
    from consumers.infer.vision import blocks as vision_blocks
    from consumers.infer.vision import checkpoint, mlp_activation

    asked = []
    monkeypatch.setattr(vision_blocks.torch, "compile", lambda fn, **kw: asked.append((fn, kw)) or fn)
    tower, _ = checkpoint.load_vision_tower(model_dir, "cpu", torch.float32)
    blocks = vision_blocks.FastVisionBlocks(tower, attention=None, compile_blocks=True)
    vision_blocks.FastVisionBlocks.remove(tower)
    assert {fn for fn, _ in asked} == {vision_blocks._before_attention, vision_blocks._after_attention,
                                       vision_blocks._project, vision_blocks._up_projection}
    assert all(kw["options"]["compile_threads"] == 1 and kw["dynamic"] and kw["fullgraph"] for _, kw in asked)
    # what the stand-in returned: the blocks call the compiled code
    assert blocks.before is vision_blocks._before_attention
    # Compiled blocks run the Triton kernels where Triton imports: q/k/v's, and one for each MLP activation that has
    # one; blocks that are not compiled run none.
    triton = mlp_activation.triton_kernels() is not None
    assert (set(blocks.mlp_kernels), blocks.rotate_qkv is not None) == (
        {mlp_activation.silu_gate, mlp_activation.gelu_tanh, mlp_activation.quick_gelu} if triton else set(), triton)
    eager = vision_blocks.FastVisionBlocks(tower, attention=None)
    vision_blocks.FastVisionBlocks.remove(tower)
    assert (eager.mlp_kernels, eager.rotate_qkv, eager.norm_kernels) == ({}, None, None)


def test_triton_qkv_kernel_splits_and_rotates_as_the_torch_code_does(interpreted_triton):
    rotate_qkv = interpreted_triton.triton_rotate_qkv()
    torch.manual_seed(0)
    for tokens, heads, dim in ((100, 4, 80), (37, 3, 72), (5, 2, 16)):  # Qwen2.5-VL's and Qwen3-VL's head widths
        angles = torch.randn(tokens, dim // 2)
        cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
        qkv = torch.randn(tokens, 3, heads, dim)
        got, expected = rotate_qkv(qkv, cos, sin, block_tokens=16), interpreted_triton.rotate_qkv_torch(qkv, cos, sin)
        for g, e in zip(got, expected, strict=True):
            assert g.is_contiguous() and g.shape == (tokens, heads, dim)
            torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-6)
        # v left in the projection (an attention that reads strided rows): a view of it, q and k as before.
        q, k, v = rotate_qkv(qkv, cos, sin, block_tokens=16, contiguous_v=False)
        assert v.data_ptr() == qkv[:, 2].data_ptr() and v.stride() == qkv[:, 2].stride()
        assert torch.equal(v, expected[2]) and torch.equal(q, got[0]) and torch.equal(k, got[1])
        # bf16: the interpreter rounds to bf16 its own way; one unit in the last place apart at most.
        got = rotate_qkv(qkv.bfloat16(), cos, sin)
        for g, e in zip(got, interpreted_triton.rotate_qkv_torch(qkv.bfloat16(), cos, sin), strict=True):
            torch.testing.assert_close(g.float(), e.float(), atol=0.04, rtol=0.01)
    with pytest.raises(ValueError, match="contiguous"):
        rotate_qkv(torch.zeros(4, 2, 2, 8), torch.zeros(4, 8), torch.zeros(4, 8))


def test_triton_mlp_activation_kernels_compute_what_the_torch_code_does(interpreted_mlp_kernels):
    kernels = interpreted_mlp_kernels.triton_kernels()
    torch.manual_seed(0)
    # Widths and row counts that fill no block exactly (the masks), and Qwen2.5-VL-7B's padded width.
    for tokens, width in ((37, 100), (16, 128), (5, 3456)):
        gate_up = torch.randn(tokens, 2 * width) * 4
        got = kernels.silu_gate(gate_up, block_tokens=16, block_width=64)
        assert got.shape == (tokens, width) and got.is_contiguous()
        torch.testing.assert_close(got, interpreted_mlp_kernels.silu_gate(gate_up), atol=1e-5, rtol=1e-5)
    # The one-input activations, out to where exp overflows float32 (GELU's tanh from exp must still give +-1).
    x = torch.cat([torch.randn(37, 100) * 4, torch.linspace(-60, 60, 3700).view(37, 100)])
    for kernel, reference in ((kernels.gelu_tanh, interpreted_mlp_kernels.gelu_tanh),
                              (kernels.quick_gelu, interpreted_mlp_kernels.quick_gelu)):
        got = kernel(x, block=256)
        assert got.shape == x.shape and torch.isfinite(got).all()
        torch.testing.assert_close(got, reference(x), atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="contiguous"):
            kernel(x.t())
    with pytest.raises(ValueError, match="contiguous"):
        kernels.silu_gate(torch.randn(4, 10).t())


@pytest.mark.parametrize("setting", [{}, {"strided_v": True}])
def test_fast_vision_blocks_with_the_triton_kernels_compute_transformers_output(setting, interpreted_triton,
                                                                              interpreted_mlp_kernels,
                                                                              interpreted_norm_kernels, images,
                                                                              model_dir):
    """The Triton kernels the fast blocks run (built for the CPU interpreter), in every block of the tiny Qwen2.5-VL
    tower: the tower's output is transformers'. With ``strided_v`` the attention gets v as a view of the projection;
    the norm kernels run in the steps beside the q/k/v and MLP kernels; the block's last residual add in the MLP's
    last product."""
    from consumers.infer.vision.blocks import FastVisionBlocks, block_kernels
    from consumers.infer.vision.checkpoint import load_vision_tower
    from consumers.infer.vision.mlp_activation import silu_gate
    from consumers.infer.vision.pixels import patchify_batch

    tower = lively(load_vision_tower(model_dir, "cpu", torch.float32)[0])  # every bias non-zero
    pixel_values, grid_thw = patchify_batch(images[:2])
    with torch.inference_mode():
        expected = tower(pixel_values, grid_thw=grid_thw).pooler_output
        blocks = FastVisionBlocks(tower, attention=None, triton=True, **setting)
        assert blocks.replaced == len(tower.blocks)
        assert block_kernels(blocks) == {"qkv": "triton, v strided" if setting.get("strided_v") else "triton",
                                         "norm": "triton", "mlp": "triton"}
        calls = {"qkv": [], "norm": [], "mlp": []}
        # The steps look the norm kernels up in their namespace at each call (a fresh one: the fixture's cache).
        for name in ("norm", "add_norm"):
            setattr(blocks.norm_kernels, name, counting(getattr(blocks.norm_kernels, name), calls["norm"]))
        blocks.rotate_qkv = counting(blocks.rotate_qkv, calls["qkv"])
        blocks.mlp_kernels[silu_gate] = counting(blocks.mlp_kernels[silu_gate], calls["mlp"])
        got = tower(pixel_values, grid_thw=grid_thw).pooler_output
        # every block went through each kernel (the norm kernels: once in each of the two steps)
        assert {kind: len(c) for kind, c in calls.items()} == {
            "qkv": len(tower.blocks), "norm": 2 * len(tower.blocks), "mlp": len(tower.blocks)}
        FastVisionBlocks.remove(tower)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_a_windowed_towers_window_blocks_take_their_own_kernel(images, model_dir):
    """``window_attention``: the tiny Qwen2.5-VL tower's window blocks call that kernel, its whole-image blocks
    (``fullatt_block_indexes``) the other, each with its own sequence bounds, and the output is transformers'."""
    from consumers.infer.vision.attention import windowed_sdpa
    from consumers.infer.vision.blocks import FastVisionBlocks
    from consumers.infer.vision.checkpoint import load_vision_tower
    from consumers.infer.vision.pixels import patchify_batch

    tower, _ = load_vision_tower(model_dir, "cpu", torch.float32)
    whole = set(tower.fullatt_block_indexes)
    assert 0 < len(whole) < len(tower.blocks)
    seen = {"window": [], "whole": []}

    def kernel(kind):
        def attend(q, k, v, cu_q, cu_k, max_q, max_k, scale):
            seen[kind].append(int(max_q))
            return windowed_sdpa(q, k, v, cu_q, scale)
        return attend

    pixel_values, grid_thw = patchify_batch(images[:2])
    with torch.inference_mode():
        expected = tower(pixel_values, grid_thw=grid_thw).pooler_output
        FastVisionBlocks(tower, attention=kernel("whole"), window_attention=kernel("window"))
        got = tower(pixel_values, grid_thw=grid_thw).pooler_output
        FastVisionBlocks.remove(tower)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)
    assert len(seen["whole"]) == len(whole) and len(seen["window"]) == len(tower.blocks) - len(whole)
    # a window holds at most window_size / patch_size squared patches; a whole image more than that
    window_patches = (tower.window_size // tower.patch_size) ** 2
    assert max(seen["window"]) <= window_patches < min(seen["whole"])


def test_the_window_blocks_keep_the_towers_attention_where_their_own_kernel_cannot_run(model_dir):
    """pick_window_attention: off CUDA, in float32, or without a varlen kernel for the whole-image blocks, the window
    blocks keep the tower's own attention (None); the encoder on the CPU has no window kernel."""
    from consumers.infer.vision.attention import pick_window_attention
    from consumers.infer.vision.checkpoint import load_vision_tower
    from consumers.infer.vision.encoder import VisionEncoder

    assert pick_window_attention("cpu", torch.float32, "sdpa") is None
    assert pick_window_attention("cpu", torch.bfloat16, "vllm_fa3") is None
    assert pick_window_attention("cuda", torch.float32, "vllm_fa3") is None
    assert pick_window_attention("cuda", torch.bfloat16, "sdpa") is None
    tower, _ = load_vision_tower(model_dir, "cpu", torch.float32)
    encoder = VisionEncoder(tower, "cpu", torch.float32)
    assert encoder.windowed and encoder.window_attention is None


def test_one_encoder_forward_over_mixed_sizes_equals_one_image_at_a_time(engine, images):
    together = engine.encoder.encode(images)
    for image, batched in zip(images, together):
        [alone] = engine.encoder.encode([image])
        assert batched.grid_thw == (1, image.shape[0] // 14, image.shape[1] // 14)
        torch.testing.assert_close(batched.tokens, alone.tokens, atol=1e-5, rtol=1e-5)


def test_text_counts_and_embedding_from_one_vision_pass(engine, images, model_dir):
    from transformers import AutoImageProcessor

    requests = [_request(i, im, want_embedding=(i != 1)) for i, im in enumerate(images[:4])]
    engine.submit(requests)
    results = {r.request_id: r for poll in _collect(engine, len(requests)) for r in poll}
    assert engine.pending() == 0

    processor = AutoImageProcessor.from_pretrained(model_dir)
    before, after = engine._prompt_parts(PROMPT)
    for request in requests:
        out = results[request.request_id]
        assert isinstance(out, InferenceOutput), out
        _, gh, gw = request.grid_thw
        assert out.visual_tokens == gh * gw // 4
        assert out.prompt_tokens == len(before) + out.visual_tokens + len(after)
        assert 1 <= out.output_tokens <= request.max_new_tokens
        assert out.text and out.timings_ms["generate_ms"] > 0
        if not request.want_embedding:
            assert out.embedding is None
            continue
        # Reference: the model's own vision tower on the processor's own pixels.
        ref = processor(images=[request.image], do_resize=False, return_tensors="pt")
        with torch.inference_mode():
            tokens = engine.model.model.get_image_features(ref["pixel_values"], ref["image_grid_thw"]).pooler_output[0]
        assert out.embedding.shape == (engine.model.config.text_config.hidden_size,)
        assert out.embedding.dtype == np.float16
        np.testing.assert_allclose(out.embedding.astype(np.float32), tokens.float().mean(0).numpy(), atol=2e-3, rtol=2e-3)
    assert len({results[r.request_id].embedding.tobytes() for r in requests if r.want_embedding}) == 3


def test_batched_output_equals_single(engine, images):
    """Left padding and M-RoPE positions are right when a request's tokens do not depend on its batch-mates."""
    alone = []
    for i in (0, 2):
        engine.submit([_request(100 + i, images[i])])
        alone.append(_collect(engine, 1)[0][0])
    engine.submit([_request(200 + i, im) for i, im in enumerate(images)])
    batched = {r.request_id: r for poll in _collect(engine, len(images)) for r in poll}
    assert [a.text for a in alone] == [batched["doc200/0"].text, batched["doc202/0"].text]


def test_more_requests_than_batch_size_arrive_as_batches_finish(model_dir, images):
    from consumers.infer.transformers_engine import TransformersEngine

    settings = InferSettings(batch_size=2)
    with TransformersEngine(model_dir, settings, device="cpu", ignore_eos=True) as eng:
        requests = [_request(i, images[i % len(images)], max_new_tokens=5) for i in range(7)]
        eng.submit(requests)
        polls = _collect(eng, len(requests))
        assert eng.pending() == 0
        # No barrier: the first answers came while later batches were still queued.
        assert len(polls[0]) <= 2 and len(polls) >= 4, [len(p) for p in polls]
        results = [r for poll in polls for r in poll]
        assert sorted(r.request_id for r in results) == sorted(r.request_id for r in requests)
        assert all(isinstance(r, InferenceOutput) and r.output_tokens == 5 for r in results)  # ignore_eos

        bad = np.zeros((30, 56, 3), np.uint8)  # not a multiple of 28: fails alone, the engine lives on
        eng.submit([InferenceRequest("bad/0", bad, (1, 2, 4), PROMPT, 4), _request(50, images[0], 4)])
        by_id = {r.request_id: r for poll in _collect(eng, 2) for r in poll}
        assert isinstance(by_id["bad/0"], InferenceFailure) and by_id["bad/0"].error_kind == "invalid_request"
        assert not by_id["bad/0"].retriable
        assert isinstance(by_id["doc50/0"], InferenceOutput)
    with pytest.raises(EngineDeadError):
        eng.submit([_request(60, images[0])])


def test_output_that_cannot_satisfy_the_schema_is_a_failure(model_dir, images, tmp_path):
    from consumers.infer.transformers_engine import TransformersEngine

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "required": ["caption"],
                                  "properties": {"caption": {"type": "string"}}}))
    with TransformersEngine(model_dir, InferSettings(output_schema=str(schema)), device="cpu") as eng:
        eng.submit([_request(0, images[0], max_new_tokens=4)])
        [[result]] = _collect(eng, 1)
    assert isinstance(result, InferenceFailure), result
    assert result.error_kind == "output_schema_violation" and result.retriable is False


def test_an_output_schema_keeps_eos_even_when_the_engine_ignores_it(model_dir, tmp_path):
    """ignore_eos (the engines' keyword for benchmarks' fixed output lengths) must not apply to guided output: the
    document has to be able to end at its closing brace. On the H200 vLLM otherwise generated past it and every
    output failed the schema."""
    from types import SimpleNamespace

    from consumers.infer.transformers_engine import TransformersEngine
    from consumers.infer.vllm_engine import VllmEngine

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"kind": {"enum": ["photo", "drawing"]}}}))
    with TransformersEngine(model_dir, InferSettings(), device="cpu", ignore_eos=True) as free:
        assert free._generation_config().eos_token_id is None
    with TransformersEngine(model_dir, InferSettings(output_schema=str(schema)), device="cpu", ignore_eos=True) as eng:
        assert eng._generation_config().eos_token_id is not None
    with TransformersEngine(model_dir, InferSettings(), device="cpu") as stops:  # a product run: EOS ends outputs
        assert stops._generation_config().eos_token_id is not None

    # The vLLM engine's request parameters, built without a GPU (vLLM's classes stand in as plain records).
    vllm_side = object.__new__(VllmEngine)
    vllm_side.settings, vllm_side.ignore_eos = InferSettings(), True
    vllm_side._v = SimpleNamespace(SamplingParams=lambda **kw: kw, StructuredOutputsParams=lambda **kw: kw,
                                   RequestOutputKind=SimpleNamespace(FINAL_ONLY="final"))
    vllm_side.schema = None
    assert vllm_side._sampling_params(8)["ignore_eos"] is True
    vllm_side.schema = OutputSchema.load(str(schema))
    params = vllm_side._sampling_params(8)
    assert params["ignore_eos"] is False and params["structured_outputs"]["json"]["properties"]["kind"]


def test_schema_check_parses_fenced_json_and_names_the_violation():
    schema = OutputSchema.from_dict({"type": "object", "required": ["caption"],
                                     "properties": {"caption": {"type": "string"}}})
    assert schema.check('```json\n{"caption": "a red car"}\n```') == {"caption": "a red car"}
    with pytest.raises(OutputSchemaViolation, match="caption"):
        schema.check('{"title": "a red car"}')


def test_vllm_engine_says_how_to_install_vllm(model_dir):
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401

        pytest.skip("vllm is installed here")
    except ImportError:
        pass
    from consumers.infer.factory import make_engine
    from consumers.infer.vllm_engine import EngineUnavailable, VllmEngine

    with pytest.raises(EngineUnavailable, match=r"pip install 'vlmstream\[gpu\]'"):
        VllmEngine(model_dir, InferSettings())
    with pytest.raises(EngineUnavailable):
        make_engine(InferSettings(engine="vllm"), model_dir)


def test_factory_picks_transformers_without_vllm_and_the_tiny_model_by_default(model_dir, images):
    from consumers.infer.factory import make_engine

    engine = make_engine(InferSettings(engine="auto", model=""))
    try:
        assert engine.name == "transformers" and engine.mode is None and not engine.ignore_eos
        assert Path(engine.model_id) == model_dir
        engine.submit([_request(0, images[0], max_new_tokens=2)])
        [[result]] = _collect(engine, 1)
        assert isinstance(result, InferenceOutput)
    finally:
        engine.close()
    # Benchmarks' fixed output lengths reach the engine through make_engine's keyword, not a setting.
    with make_engine(InferSettings(engine="transformers"), model_dir, ignore_eos=True) as fixed:
        assert fixed.ignore_eos


def test_encoder_groups_keep_order_and_stay_within_the_patch_bound():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from consumers.infer.vision.encoder import groups_by_patches

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.integers(1, 5000), max_size=40), st.integers(1, 8000))
    def check(sizes, bound):
        groups = list(groups_by_patches(sizes, lambda n: n, bound))
        assert [n for g in groups for n in g] == sizes
        assert all(g and (sum(g) <= bound or len(g) == 1) for g in groups)
        # Greedy: a group closes only because the next item would not fit.
        assert all(sum(a) + b[0] > bound for a, b in zip(groups, groups[1:]))

    check()


def _torch_threads_in_child(queue) -> None:
    import torch

    queue.put(torch.get_num_threads())


def test_vllm_engine_process_starts_with_few_cpu_threads_and_this_one_keeps_its_own(monkeypatch):
    """The context vLLM's engine process is started in: a spawned child gets one torch thread (vLLM's one-GPU engine
    would otherwise keep one per core, spinning), the parent keeps its count, and a user's own value wins."""
    import multiprocessing
    import os

    import torch

    from vlmstream.vllm_process import engine_process_threads

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        ctx = multiprocessing.get_context("spawn")
        with engine_process_threads():
            assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
            queue = ctx.Queue()
            child = ctx.Process(target=_torch_threads_in_child, args=(queue,))
            child.start()
            assert queue.get(timeout=120) == 1
            child.join(30)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert "OMP_NUM_THREADS" not in os.environ and "VLLM_WORKER_MULTIPROC_METHOD" not in os.environ
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    with engine_process_threads():
        assert os.environ["OMP_NUM_THREADS"] == "3"


def test_the_encoder_hands_transformers_the_index_tensors_it_derived_on_the_cpu(images, model_dir):
    """Derived from the grid on the CPU (a grid on the GPU makes transformers wait for the GPU several times per
    forward), and really used: a forward given altered positions computes something else."""
    from consumers.infer.vision.checkpoint import load_vision_tower
    from consumers.infer.vision.encoder import VisionEncoder
    from consumers.infer.vision.pixels import patchify_batch

    tower, _ = load_vision_tower(model_dir, "cpu", torch.float32)
    encoder = VisionEncoder(tower, "cpu", torch.float32, attention="sdpa")
    pixel_values, grid_thw = patchify_batch(images[:3])
    assert grid_thw.device.type == "cpu"
    inputs = encoder._index_inputs(grid_thw)
    assert set(inputs) == {"position_ids", "cu_seqlens", "max_seqlen", "window_index", "cu_window_seqlens",
                           "max_window_seqlen"}
    assert inputs["max_seqlen"] == int(grid_thw[:, 1:].prod(-1).max())  # one image's patches, unwindowed
    given_inputs = encoder._index_inputs(grid_thw)
    altered_inputs = {**encoder._index_inputs(grid_thw), "position_ids": torch.zeros_like(inputs["position_ids"])}
    derivations = []
    real_unique_consecutive = torch.unique_consecutive

    def counting_unique_consecutive(*args, **kwargs):  # transformers calls it when it derives the window bounds
        derivations.append(1)
        return real_unique_consecutive(*args, **kwargs)

    torch.unique_consecutive = counting_unique_consecutive
    try:
        with torch.inference_mode():
            derived = tower(pixel_values, grid_thw=grid_thw).pooler_output
            assert len(derivations) == 1
            given = tower(pixel_values, grid_thw=grid_thw, **given_inputs).pooler_output
            assert len(derivations) == 1  # with ours given, transformers derived none of its own
            altered = tower(pixel_values, grid_thw=grid_thw, **altered_inputs)
    finally:
        torch.unique_consecutive = real_unique_consecutive
    torch.testing.assert_close(given, derived, atol=1e-5, rtol=1e-4)
    assert not torch.equal(altered.pooler_output, derived)  # the positions given are the ones used


def test_pooled_embeddings_leave_in_one_copy_and_each_images_tokens_own_storage(monkeypatch):
    """A batch's pooled embeddings come to the host in one copy (each blocking copy waits for a GPU that the
    language model shares), equal to the one-image definitions, and every image's tokens own their storage (vLLM
    ships a tensor's whole storage, so a view would carry the batch). On CUDA the tokens go by DMA into one pinned
    tensor per image with a single wait; this machine checks the values and the storage."""
    from consumers.infer.vision.outputs import mean_pool, mean_pool_each, to_host_each

    generator = torch.Generator().manual_seed(7)
    merged = torch.randn(5 + 9 + 1, 16, generator=generator).to(torch.bfloat16)
    tokens = list(merged.split([5, 9, 1]))
    copies = []
    real_cpu = torch.Tensor.cpu

    def counting_cpu(self, *args, **kwargs):
        copies.append(tuple(self.shape))
        return real_cpu(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "cpu", counting_cpu)
    pooled = mean_pool_each(tokens)
    host = to_host_each(tokens)
    assert copies == [(3, 16)]  # the pooled batch in one copy, not one per image
    monkeypatch.setattr(torch.Tensor, "cpu", real_cpu)
    for one, together in zip(tokens, pooled):
        assert together.dtype == np.float16 and np.array_equal(together, mean_pool(one))
    for one, own in zip(tokens, host):
        assert torch.equal(own, one)
        assert own.untyped_storage().nbytes() == own.numel() * own.element_size()
    assert mean_pool_each([]) == [] and to_host_each([]) == []


class QwenModelLikeVllms:
    """The part of vLLM's Qwen model classes that engine_tower.install replaces and reads: ``_process_image_input``
    (vLLM's own tower: here a marker), ``parameters()`` (for the device) and ``model_config.dtype`` (the model's
    dtype). The checkpoint is the one the consumer's EngineTowerConfig names."""

    def __init__(self):
        self.language_model = torch.nn.Linear(2, 2)
        self.model_config = types.SimpleNamespace(dtype=torch.float32)

    def parameters(self):
        return self.language_model.parameters()

    def _process_image_input(self, image_input):
        return ("vllm's own tower", image_input["type"])


def test_the_engine_tower_takes_pixel_rows_and_leaves_the_rest_to_vllm(images, model_dir, monkeypatch,
                                                                       engine_tower_config):
    """Our tower in vLLM's engine process: a Qwen model class's pixel rows (the decoded images' own bytes as uint8
    image_embeds) go through our encoder, built once from the checkpoint, and give per image what transformers'
    tower gives; the processor's pixel_values and other image_embeds keep vLLM's own path. Installing twice wraps
    once."""
    from transformers import AutoImageProcessor

    from consumers.infer import engine_tower
    from consumers.infer.vision.checkpoint import load_vision_tower

    engine_tower_config(model_dir)
    original = QwenModelLikeVllms._process_image_input
    monkeypatch.setattr(QwenModelLikeVllms, "_process_image_input", original)  # undone after the test
    assert engine_tower.install([(__name__, "QwenModelLikeVllms"), ("vllm_is_not_here", "Nothing")]) == [
        "QwenModelLikeVllms"]
    wrapped = QwenModelLikeVllms._process_image_input
    assert wrapped is not original and engine_tower.install([(__name__, "QwenModelLikeVllms")])
    assert QwenModelLikeVllms._process_image_input is wrapped

    processor = AutoImageProcessor.from_pretrained(model_dir)
    inputs = processor(images=images[:3], do_resize=False, return_tensors="pt")
    pixel_input = {"type": "pixel_values", "pixel_values": inputs["pixel_values"],
                   "image_grid_thw": inputs["image_grid_thw"]}
    tower, _ = load_vision_tower(model_dir, "cpu", torch.float32)
    with torch.inference_mode():
        expected = tower(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"]).pooler_output.split(
            (inputs["image_grid_thw"].prod(-1) // 4).tolist())

    model = QwenModelLikeVllms()
    assert model._process_image_input(pixel_input) == ("vllm's own tower", "pixel_values")
    assert model not in engine_tower._encoders
    # The decoded images' own bytes as uint8 image_embeds rows.
    from consumers.infer import pixel_rows
    from vlmstream.models.registry import family_of

    rows = torch.cat([pixel_rows.pack(np.asarray(image), tuple(grid), family_of(model_dir))
                      for image, grid in zip(images[:3], inputs["image_grid_thw"].tolist())])
    rows_input = {"type": "image_embeds", "image_embeds": rows, "image_grid_thw": inputs["image_grid_thw"]}
    got = model._process_image_input(rows_input)
    assert isinstance(got, tuple) and len(got) == 3
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
    encoder = engine_tower._encoders[model]
    assert encoder.fast is not None and not encoder.compiled  # CPU: fast blocks, not compiled
    # With embeddings published the rows carry tags, and the engine keeps each image's embedding under its tag
    # for the consumer: the family's embedding (the mean of the merged tokens), each given once. Untagged rows keep
    # none.
    tags = [7, 2**40 + 3, 12]
    tagged = torch.cat([pixel_rows.pack(np.asarray(image), tuple(grid), encoder.family, tag)
                        for image, grid, tag in zip(images[:3], inputs["image_grid_thw"].tolist(), tags)])
    tagged_input = {"type": "image_embeds", "image_embeds": tagged, "image_grid_thw": inputs["image_grid_thw"]}
    for g, e in zip(model._process_image_input(tagged_input), expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
    kept = engine_tower.tap().take(tags + [99])
    assert sorted(kept) == sorted(tags)  # 99 was never kept
    torch.testing.assert_close(model._process_image_input(rows_input)[0], expected[0], atol=1e-4, rtol=1e-4)
    assert engine_tower.tap().totals()["waiting"] == 0  # untagged rows keep nothing
    for tag, e in zip(tags, expected):
        got_embedding = np.frombuffer(kept[tag], dtype=np.float16)
        np.testing.assert_allclose(got_embedding, e[:, :encoder.embedding_width].mean(0).numpy(), atol=2e-3, rtol=2e-3)
    assert engine_tower.tap().take(tags) == {}
    model._process_image_input(rows_input)
    assert engine_tower._encoders[model] is encoder  # built once
    worker = engine_tower.EngineTowerExtension()
    worker.model_runner = types.SimpleNamespace(get_model=lambda: model)  # vLLM's worker holds its runner
    report = worker.vlmstream_tower_report()
    assert report["model"] == {"class": "QwenModelLikeVllms", "wrapped": True}
    # A model of a class the wrapper is not in (VllmEngine then refuses to start), or no model to ask about.
    worker.model_runner = types.SimpleNamespace(get_model=lambda: torch.nn.Linear(2, 2))
    assert engine_tower.model_takes_it(worker) == {"class": "Linear", "wrapped": False}
    worker.model_runner = types.SimpleNamespace(get_model=lambda: types.SimpleNamespace(unwrap=lambda: model))
    assert engine_tower.model_takes_it(worker)["wrapped"] is True  # through a CUDA graph wrapper
    assert engine_tower.model_takes_it(object())["wrapped"] is False
    assert {"fast_blocks": encoder.fast.replaced, "compiled": False, "attention": "sdpa",
            "image_embeds_width": encoder.image_embeds_width} in report["encoders"]
    assert report["clock"] == {"forwards": 0, "images": 0, "gpu_ms": 0.0}  # CPU tensors: no CUDA events to time
    assert report["embeddings"]["taken"] >= 3 and report["embeddings"]["waiting"] == 0
    assert worker.vlmstream_take_embeddings([7]) == {}

    embeds_input = {"type": "image_embeds", "image_embeds": torch.zeros(4, 8), "image_grid_thw": torch.ones(1, 3)}
    assert model._process_image_input(embeds_input) == ("vllm's own tower", "image_embeds")
    engine_tower._encoders.pop(model)


def test_the_worker_extension_vllm_is_given_is_there():
    """VllmEngine names our worker extension to vLLM by its dotted name; vLLM's worker imports the module and finds
    the class there (installing our tower as it imports)."""
    from consumers.infer.vllm_engine_tower import ENGINE_TOWER_EXTENSION

    module, _, name = ENGINE_TOWER_EXTENSION.rpartition(".")
    assert hasattr(importlib.import_module(module), name)


def test_a_host_that_refuses_page_locked_memory_gets_plain_copies_from_then_on(monkeypatch, caplog):
    """pixels.page_locked: what the allocation makes while the host gives page-locked memory; once it refuses,
    None (the callers then copy through pageable memory), said once, and the allocation is never tried again."""
    from consumers.infer.vision import pixels

    monkeypatch.setattr(pixels, "_pinning", True)
    assert pixels.page_locked(lambda: "pinned") == "pinned"
    calls = []

    def refuse():
        calls.append(1)
        raise RuntimeError("cudaHostAlloc: out of memory")

    with caplog.at_level("WARNING", logger=pixels.__name__):
        assert pixels.page_locked(refuse) is None
        assert pixels.page_locked(refuse) is None
        assert pixels.page_locked(lambda: "pinned") is None
    assert calls == [1]
    assert sum("page-locked memory unavailable" in r.getMessage() for r in caplog.records) == 1
    assert pixels.to_device(torch.ones(2), torch.device("cpu")).tolist() == [1.0, 1.0]


class StepEvent:
    """A CUDA event's part that TowerClock uses, on a clock the test moves: recorded at the time it is recorded,
    passed (query) once the test says the GPU got there."""
    now_ms = 0.0
    reached_ms = 0.0

    def record(self):
        self.at = StepEvent.now_ms

    def query(self):
        return self.at <= StepEvent.reached_ms

    def elapsed_time(self, other):
        return other.at - self.at


def test_the_engine_tower_clock_counts_a_forward_once_the_gpu_has_passed_it():
    """engine_tower.TowerClock: each forward's GPU time from its two events, counted only after the GPU passed the
    second (nothing waits), in the order the forwards ran."""
    from consumers.infer.engine_tower import TowerClock

    clock = TowerClock(event=StepEvent)
    StepEvent.now_ms, StepEvent.reached_ms = 0.0, -1.0
    first = clock.start()
    StepEvent.now_ms = 30.0
    clock.stop(first, images=2)
    second = clock.start()
    StepEvent.now_ms = 50.0
    clock.stop(second, images=1)
    assert clock.totals() == {"forwards": 0, "images": 0, "gpu_ms": 0.0}  # the GPU has passed neither yet
    StepEvent.reached_ms = 30.0
    assert clock.totals() == {"forwards": 1, "images": 2, "gpu_ms": 30.0}
    StepEvent.reached_ms = 50.0
    assert clock.totals() == {"forwards": 2, "images": 3, "gpu_ms": 50.0}


def test_the_engine_towers_clock_times_its_forwards_on_the_gpu_only(monkeypatch):
    """Each forward of our tower in the engine whose input is on the GPU is counted by the clock with its images;
    one on the CPU is not (no CUDA events there)."""
    from consumers.infer import engine_tower

    clock = engine_tower.TowerClock(event=StepEvent)
    monkeypatch.setattr(engine_tower, "CLOCK", clock)
    StepEvent.now_ms, StepEvent.reached_ms = 100.0, 1e9
    assert engine_tower._clocked(types.SimpleNamespace(is_cuda=True), lambda: ("a", "b")) == ("a", "b")
    assert engine_tower._clocked(torch.zeros(1), lambda: ("c",)) == ("c",)
    assert clock.totals() == {"forwards": 1, "images": 2, "gpu_ms": 0.0}


def test_the_engine_process_installs_our_tower_where_vllm_is(monkeypatch, model_dir, engine_tower_config, caplog):
    """What engine_tower's import installs: our tower in vLLM's Qwen model classes; none where vLLM is not
    installed; a clear error without the consumer's configuration; none, with a warning naming both releases, on a
    vLLM release other than the checked one or than the consumer's."""
    from consumers.infer import engine_tower
    from consumers.infer.engine_boundary import ENVIRONMENT_VARIABLE
    from vlmstream import vllm_adapter

    monkeypatch.setattr(engine_tower.importlib.util, "find_spec", lambda name: None)
    assert engine_tower._installed_on_import() == []
    monkeypatch.setattr(engine_tower.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(engine_tower, "install", lambda: ["Qwen2_5_VLForConditionalGeneration"])
    monkeypatch.delenv(ENVIRONMENT_VARIABLE, raising=False)
    monkeypatch.setattr(engine_tower, "_config", None)
    with pytest.raises(RuntimeError, match=f"{ENVIRONMENT_VARIABLE} is not set"):
        engine_tower._installed_on_import()
    checked = vllm_adapter.CHECKED_VLLM
    major, minor, _ = checked.split(".")
    patch_release, other_series = f"{major}.{minor}.1", f"{major}.{int(minor) + 1}.1"
    engine_tower_config(model_dir)  # the consumer checked CHECKED_VLLM
    monkeypatch.setattr(vllm_adapter, "installed_vllm", lambda: checked)
    assert engine_tower._installed_on_import() == ["Qwen2_5_VLForConditionalGeneration"]
    with caplog.at_level("WARNING", logger=engine_tower.__name__):
        monkeypatch.setattr(vllm_adapter, "installed_vllm", lambda: other_series)
        assert engine_tower._installed_on_import() == []
        monkeypatch.setattr(vllm_adapter, "installed_vllm", lambda: patch_release)  # the checked series, not the consumer's
        assert engine_tower._installed_on_import() == []
    warnings = [r.getMessage() for r in caplog.records]
    assert any(other_series in w and checked in w for w in warnings)
    assert any(patch_release in w and checked in w for w in warnings)


def test_pixel_rows_carry_an_exact_size_image_to_the_engine_and_back_unchanged():
    """pixel_rows: an exact-size image's bytes as one row per merged visual token (the rows vLLM splits image_embeds
    by), shared with the image; several images' rows, concatenated as vLLM batches them, come back as the same
    images. A wrong size or dtype is refused, naming what was expected."""
    from consumers.infer import pixel_rows
    from vlmstream.models.qwen2_vl import QWEN2_VL
    from vlmstream.models.qwen3_vl import QWEN3_VL

    rng = np.random.default_rng(0)
    for family in (QWEN2_VL, QWEN3_VL):
        f = family.factor
        images = [rng.integers(0, 256, (h * f, w * f, 3), dtype=np.uint8) for h, w in ((2, 3), (5, 1), (1, 1))]
        grids = [family.grid_thw(image.shape[0], image.shape[1]) for image in images]
        packed = [pixel_rows.pack(image, grid, family) for image, grid in zip(images, grids)]
        for image, grid, rows in zip(images, grids, packed):
            assert rows.shape == (family.visual_tokens(grid), pixel_rows.row_width(family)) and rows.dtype == torch.uint8
            assert rows.data_ptr() == torch.from_numpy(image).data_ptr()  # no copy
        back = pixel_rows.unpack(torch.cat(packed), torch.tensor(grids), family)
        assert [b.numpy().tobytes() for b in back] == [image.tobytes() for image in images]
        assert pixel_rows.are_pixel_rows({"type": "image_embeds", "image_embeds": torch.cat(packed)})
    assert not pixel_rows.are_pixel_rows({"type": "image_embeds", "image_embeds": torch.zeros(2, 8)})
    assert pixel_rows.row_width(QWEN2_VL) == 2352 and pixel_rows.row_width(QWEN3_VL) == 3072
    with pytest.raises(ValueError, match="expected a 28 x 28 x 3 uint8"):
        pixel_rows.pack(np.zeros((28, 28, 3), np.float32), (1, 2, 2), QWEN2_VL)
    # Tagged rows (embeddings published): a copy, TAG_BYTES wider, the tag in the first row; the same images back.
    for family in (QWEN2_VL, QWEN3_VL):
        f = family.factor
        images = [rng.integers(0, 256, (h * f, w * f, 3), dtype=np.uint8) for h, w in ((2, 3), (5, 1), (1, 1))]
        grids = [family.grid_thw(image.shape[0], image.shape[1]) for image in images]
        tags = [1, 2**63 + 5, 0xABCDEF]
        packed = [pixel_rows.pack(image, grid, family, tag) for image, grid, tag in zip(images, grids, tags)]
        width = pixel_rows.row_width(family)
        for image, grid, rows in zip(images, grids, packed):
            assert rows.shape == (family.visual_tokens(grid), width + pixel_rows.TAG_BYTES)
            assert not rows[1:, width:].any()  # the tag sits in the first row only
        rows = torch.cat(packed)
        back = pixel_rows.unpack(rows, torch.tensor(grids), family)
        assert [b.numpy().tobytes() for b in back] == [image.tobytes() for image in images]
        assert pixel_rows.tag_values(pixel_rows.tags(rows, torch.tensor(grids), family)) == tags
        assert pixel_rows.tags(torch.cat([pixel_rows.pack(i, g, family) for i, g in zip(images, grids)]),
                               torch.tensor(grids), family) is None
    with pytest.raises(ValueError, match=r"expected uint8 \(1, 2352\)"):
        pixel_rows.unpack(torch.zeros(2, 2352, dtype=torch.uint8), torch.tensor([[1, 2, 2]]), QWEN2_VL)


def test_the_embedding_tap_keeps_each_tagged_image_once_and_the_newest_when_full():
    """EmbeddingTap (vLLM's engine process): each forward's embeddings are the mean of the first ``width`` columns of
    each image's tokens (Qwen3-VL's DeepStack levels left out), kept by tag, each taken once; past ``keep`` the oldest
    go, counted as dropped."""
    from consumers.infer import engine_tower, pixel_rows

    def tag_bytes(*tags):
        return torch.from_numpy(np.array(tags, dtype="<u8").view(np.uint8).reshape(len(tags), pixel_rows.TAG_BYTES))

    tap = engine_tower.EmbeddingTap(keep=3)
    t10, t11, t12, t13 = 10, 11, 12, 2**40 + 13
    tokens = [torch.arange(24, dtype=torch.float32).reshape(4, 6) + i for i in range(4)]
    tap.put(tag_bytes(t10, t11), tokens[:2], width=2)
    tap.put(tag_bytes(t12, t13), [tokens[2], tokens[3]], width=2)
    assert tap.take([t11]) == {t11: np.array([9.0 + 1, 10.0 + 1], np.float16).tobytes()}  # mean of rows, columns 0-1
    assert tap.take([t10, 14]) == {}  # the oldest of four, one too many for keep=3; one never put
    assert sorted(tap.take([t12, t13, t11])) == [t12, t13]
    assert tap.totals() == {"kept": 4, "taken": 3, "dropped": 1, "waiting": 0}


def test_engine_embeddings_are_taken_for_all_waiting_requests_in_few_calls():
    """EngineEmbeddings (the consumer's side): requests that finish together share one call to vLLM's engine; a tag
    the engine kept nothing for gives None; a failed call fails the requests that waited on it, and the next call
    serves the next ones."""
    import asyncio

    from consumers.infer.vllm_engine_tower import EngineEmbeddings

    calls = []

    async def fetch(tags):
        calls.append(sorted(tags))
        await asyncio.sleep(0.01)
        if 666 in tags:
            raise RuntimeError("engine gone")
        return {t: np.full(4, t, np.float16).tobytes() for t in tags if t != 3}

    async def main():
        taps = EngineEmbeddings(fetch)
        got = await asyncio.gather(*(taps.take(t) for t in (1, 2, 3)))
        later = await asyncio.gather(taps.take(4), return_exceptions=True)
        failed = await asyncio.gather(taps.take(666), return_exceptions=True)
        after = await taps.take(5)
        return got, later, failed, after

    got, later, failed, after = asyncio.run(main())
    assert [None if g is None else g.tolist() for g in got] == [[1.0] * 4, [2.0] * 4, None]
    assert calls[0] == [1, 2, 3] and later[0].tolist() == [4.0] * 4
    assert isinstance(failed[0], RuntimeError) and after.tolist() == [5.0] * 4


def test_strided_v_is_used_only_with_an_attention_kernel_that_gives_the_same_output_with_it(monkeypatch):
    """The probe behind ``strided_v=None``: a kernel that reads v's rows where they lie says yes; one that fails on
    a view, or answers differently with one, says no (the blocks then copy v, as before)."""
    from consumers.infer.vision import attention

    def by_sdpa(q, k, v, cu_q, cu_k, max_q, max_k, scale):  # reads v through its strides, as FA3 does
        return torch.cat([torch.nn.functional.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1) for t in (q, k, v)), scale=scale).transpose(0, 1)
            for a, b in zip(cu_q.tolist(), cu_q.tolist()[1:])])

    def needs_contiguous_v(q, k, v, *rest):
        if not v.is_contiguous():
            raise ValueError("v must be contiguous")
        return by_sdpa(q, k, v, *rest)

    def reads_v_as_if_packed(q, k, v, *rest):  # ignores v's strides: wrong numbers from a view
        return by_sdpa(q, k, torch.as_strided(v, v.shape, (v.shape[1] * v.shape[2], v.shape[2], 1)), *rest)

    monkeypatch.setattr(attention, "_STRIDED_V", {})
    for name, kernel, expected in (("views", by_sdpa, True), ("contiguous-only", needs_contiguous_v, False),
                                   ("strides-ignored", reads_v_as_if_packed, False)):
        monkeypatch.setitem(attention.VARLEN_KERNELS, name, kernel)
        assert attention.takes_strided_v(name, "cpu", torch.float32) is expected, name
    assert not attention.takes_strided_v("not-registered", "cpu", torch.float32)


def test_triton_norm_kernels_compute_what_the_torch_code_does(interpreted_norm_kernels):
    """RMSNorm (no bias) and LayerNorm, alone and after the residual add, on rows that fill no block exactly and on
    the towers' own widths (1,280 and 1,152: wider than Inductor's one-pass limit)."""
    kernels = interpreted_norm_kernels.triton_kernels()
    torch.manual_seed(0)
    for rows, width in ((37, 100), (5, 1280), (3, 1152)):
        x, y = torch.randn(rows, width) * 3 + 1, torch.randn(rows, width)
        weight, bias = torch.randn(width), torch.randn(width)
        for b in (None, bias):
            torch.testing.assert_close(kernels.norm(x, weight, b, 1e-6),
                                       interpreted_norm_kernels.norm(x, weight, b, 1e-6), atol=1e-5, rtol=1e-5)
            total, normed = kernels.add_norm(x, y, weight, b, 1e-6)
            expected_total, expected = interpreted_norm_kernels.add_norm(x, y, weight, b, 1e-6)
            assert torch.equal(total, expected_total)
            torch.testing.assert_close(normed, expected, atol=1e-5, rtol=1e-5)
            # A shift (the MLP's last bias, carried in the residual stream) moves the sum, not its norm.
            shift = torch.randn(width)
            shifted, normed_shifted = kernels.add_norm(x, y, weight, b, 1e-6, shift=shift)
            torch.testing.assert_close(shifted, expected_total + shift, atol=1e-6, rtol=1e-6)
            torch.testing.assert_close(normed_shifted, expected, atol=1e-5, rtol=1e-5)
            # bf16: the interpreter rounds to bf16 its own way; a unit in the last place apart at most.
            total, normed = kernels.add_norm(x.bfloat16(), y.bfloat16(), weight.bfloat16(),
                                             None if b is None else b.bfloat16(), 1e-6)
            expected_total, expected = interpreted_norm_kernels.add_norm(
                x.bfloat16(), y.bfloat16(), weight.bfloat16(), None if b is None else b.bfloat16(), 1e-6)
            assert total.dtype == normed.dtype == torch.bfloat16
            torch.testing.assert_close(total.float(), expected_total.float(), atol=0.07, rtol=0.01)
            torch.testing.assert_close(normed.float(), expected.float(), atol=0.07, rtol=0.02)
    # Any layout and leading axes: the rows of the last axis.
    x, weight = torch.randn(2, 8, 5).transpose(1, 2), torch.randn(8)
    torch.testing.assert_close(kernels.norm(x, weight, None, 1e-6),
                               interpreted_norm_kernels.norm(x, weight, None, 1e-6), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="one shape"):
        kernels.add_norm(torch.randn(4, 8), torch.randn(8, 4), weight, None, 1e-6)


def test_norm_kernels_that_disagree_with_torch_are_not_used(interpreted_norm_kernels, interpreted_mlp_kernels,
                                                            model_dir, caplog, monkeypatch):
    """The blocks probe the Triton norms once against torch's on the tower's own width, dtype and device: kernels
    that answer otherwise are dropped with a warning, and the blocks run the torch code."""
    from types import SimpleNamespace

    from consumers.infer.vision import blocks as vision_blocks
    from consumers.infer.vision import checkpoint

    tower, _ = checkpoint.load_vision_tower(model_dir, "cpu", torch.float32)
    blocks = vision_blocks.FastVisionBlocks(tower, attention=None, triton=True)
    assert vision_blocks.block_kernels(blocks)["norm"] == "triton" and blocks.project is not vision_blocks._project
    kernels = interpreted_norm_kernels.triton_kernels()
    off_by_one = SimpleNamespace(norm=lambda *args: kernels.norm(*args) + 1, add_norm=kernels.add_norm)
    monkeypatch.setattr(vision_blocks, "triton_norm_kernels", lambda: off_by_one)
    with caplog.at_level("WARNING"):
        blocks = vision_blocks.FastVisionBlocks(tower, attention=None, triton=True)
    vision_blocks.FastVisionBlocks.remove(tower)
    assert vision_blocks.block_kernels(blocks)["norm"] == "torch" and blocks.project is vision_blocks._project
    assert "disagree" in caplog.text


def test_next_batch_takes_what_is_queued_and_waits_only_when_asked():
    """The vLLM encoder thread asks without waiting while a tower pass is still on the GPU (it then waits for that
    pass instead), and with waiting once nothing is in flight."""
    from vlmstream.queued_engine import QueuedEngine

    engine = QueuedEngine()
    engine._init_queues()
    assert engine._next_batch(4, block=False) == ([], False)
    engine.submit(["a", "b", "c"])
    batch, stopping = engine._next_batch(2, block=False)
    assert [r for r, _ in batch] == ["a", "b"] and not stopping
    batch, stopping = engine._next_batch(2)
    assert [r for r, _ in batch] == ["c"] and not stopping
    assert engine._next_batch(2, block=False) == ([], False)


@pytest.mark.parametrize("family", ["qwen2.5-vl", "qwen3-vl"])
def test_index_tensors_from_each_grids_kept_part_equal_transformers_derivation_of_the_batch(family, model_dir,
                                                                                            tmp_path):
    """VisionEncoder._index_inputs builds a batch's index tensors from each image grid's part, derived once and
    kept (GridIndexParts): equal, tensor for tensor, to transformers' vision_utils over the whole batch (window
    order and bounds of Qwen2.5-VL's windowed tower, the learned grid's taps and weights of Qwen3-VL's), and a
    batch of grids seen before derives nothing new."""
    from transformers import vision_utils

    from consumers.infer.tiny_model import write_tiny_family_model
    from consumers.infer.vision.checkpoint import load_vision_tower
    from consumers.infer.vision.encoder import VisionEncoder

    path = model_dir if family == "qwen2.5-vl" else write_tiny_family_model(tmp_path / family, family)
    tower, _ = load_vision_tower(path, "cpu", torch.float32)
    encoder = VisionEncoder(tower, "cpu", torch.float32, attention="sdpa")
    visual = encoder.visual
    # Grids of several shapes and repeats, one whose side is a whole number of windows and one that is not.
    grid = torch.tensor([[1, 16, 16], [1, 12, 20], [1, 16, 16], [1, 8, 32], [1, 36, 6], [1, 12, 20]])
    expected = {"position_ids": vision_utils.get_vision_position_ids(grid, visual.spatial_merge_size),
                "cu_seqlens": vision_utils.get_vision_cu_seqlens(grid)}
    if family == "qwen2.5-vl":
        expected["window_index"], expected["cu_window_seqlens"] = vision_utils.get_vision_window_index(
            grid, spatial_merge_size=visual.spatial_merge_size, window_size=visual.window_size,
            patch_size=visual.patch_size)
    else:
        expected["interp_indices"], expected["interp_weights"] = \
            vision_utils.get_vision_interpolation_indices_and_weights(
                grid, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
                align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.config.spatial_merge_size)
    for _ in range(2):
        inputs = encoder._index_inputs(grid)
        for name, tensor in expected.items():
            assert inputs[name].dtype == tensor.dtype and torch.equal(inputs[name], tensor), name
        assert len(encoder._grid_parts) == 4  # four distinct grids, derived once each
    parts = encoder._grid_parts
    parts.max_bytes = 1  # over the cap: the least recently used grid goes, the newest stays
    parts.get((1, 4, 4))
    assert len(parts) == 1 and parts.get((1, 4, 4)) is parts.get((1, 4, 4))


def test_the_vllm_encoder_thread_keeps_a_pass_queued_and_hands_every_image_over_once(model_dir, monkeypatch):
    """VllmEngine._encode_loop on the CPU (no vLLM: what it hands to vLLM is recorded instead): every valid request
    is handed over once, with the tower's image_embeds and, where asked, its embedding, equal to the encoder's own;
    an invalid one fails by itself; a pass is waited for only after the next one is queued behind it, or once nothing
    more is waiting; the passes' spans add up to no more than the wall time."""
    from consumers.infer.engine import InferenceRequest
    from consumers.infer.vision.checkpoint import load_vision_tower
    from consumers.infer.vision.encoder import VisionEncoder
    from consumers.infer import vllm_encoder_thread
    from consumers.infer.vllm_engine import VllmEngine
    from vlmstream.models.qwen2_vl import QWEN2_VL
    from vlmstream.queued_engine import ENGINE_STOP

    tower, _ = load_vision_tower(model_dir, "cpu", torch.float32)
    encoder = VisionEncoder(tower, "cpu", torch.float32, attention="sdpa", max_patches_per_call=2 * 16 * 16)
    engine = object.__new__(VllmEngine)
    engine._init_queues()
    engine.mode, engine._tower_in_engine, engine.family, engine.encoder = "embeds", False, QWEN2_VL, encoder
    engine.settings = InferSettings()
    monkeypatch.setattr(vllm_encoder_thread, "VISION_BATCH_IMAGES", 3)
    engine.image_embeds_width, engine._torch, engine._stream = encoder.image_embeds_width, torch, None
    engine._last_pass_finished = 0.0
    handed, events = [], []
    monkeypatch.setattr(engine, "_dispatch", lambda items, encoded: handed.extend(
        (request, encoded.get(request.request_id)) for request, _ in items))
    launch = encoder.launch

    def logged_launch(images, *args):
        events.append(("launch", len(images)))
        tower_pass = launch(images, *args)
        real_wait = tower_pass.wait
        tower_pass.wait = lambda: (events.append(("wait", len(images))), real_wait())[1]
        return tower_pass

    monkeypatch.setattr(encoder, "launch", logged_launch)
    rng = np.random.default_rng(3)
    requests = [InferenceRequest(f"r{i}", rng.integers(0, 256, (16 * 14, 16 * 14, 3), dtype=np.uint8), (1, 16, 16),
                                 "p", 4, want_embedding=i % 2 == 0) for i in range(7)]
    bad = InferenceRequest("bad", np.zeros((10, 10, 3), np.uint8), (1, 16, 16), "p", 4)
    engine.submit([*requests[:3], bad, *requests[3:]])
    engine._inbox.put(ENGINE_STOP)
    started = time.perf_counter()
    engine._encode_loop()
    wall_ms = (time.perf_counter() - started) * 1e3

    assert engine._dead is None
    failures = engine.poll(0)
    assert [f.request_id for f in failures] == ["bad"] and failures[0].error_kind == "invalid_request"
    assert sorted(r.request_id for r, _ in handed) == sorted(r.request_id for r in requests)  # each once
    expected = {e.request_id: tokens for e, tokens in zip(requests, (x.tokens for x in encoder.encode(
        [r.image for r in requests])))}
    spans = set()
    for request, (image_embeds, embedding, timings) in handed:
        torch.testing.assert_close(image_embeds, expected[request.request_id], atol=1e-5, rtol=1e-5)
        assert (embedding is not None) == request.want_embedding
        spans.add((timings["encode_ms"], timings["encode_batch_images"]))
    assert sum(ms for ms, _ in spans) <= wall_ms
    # Batches of 3 (the bad one in the second), passes of at most 2 images: the thread waits for a pass only with
    # the next one queued behind it (two outstanding), except when nothing more is waiting; never more than two.
    launches = [n for kind, n in events if kind == "launch"]
    assert sum(launches) == 7 and max(launches) <= 2
    outstanding, most = 0, 0
    for kind, _ in events:
        outstanding += 1 if kind == "launch" else -1
        most = max(most, outstanding)
        assert 0 <= outstanding <= 2, events
    assert most == 2 and outstanding == 0, events


@pytest.mark.parametrize("model, linear_attention", [("qwen3.5-27b", True), ("qwen3.5-397b-a17b", True),
                                                     ("qwen2.5-vl-7b", False), ("qwen3-vl-8b", False)])
def test_vllm_is_asked_for_its_triton_deltanet_kernel_only_where_flashinfer_would_be_missed(
        model, linear_attention, tmp_path, monkeypatch):
    """kernel_args: a model with Gated DeltaNet layers (Qwen3.5) gets vLLM's Triton prefill kernel when FlashInfer's
    is not installed (vLLM 0.26 would pick FlashInfer's on Hopper and die at the first prefill); with FlashInfer,
    or for a model without those layers, vLLM keeps its own choice. Real configs, as the GPU runs use them."""
    from benchmarks.model7b import GPU_MODELS
    from vlmstream import vllm_process

    folder = GPU_MODELS[model](tmp_path / model)
    monkeypatch.setattr(vllm_process, "flashinfer_gdn_installed", lambda: False)
    assert vllm_process.kernel_args(folder) == ({"gdn_prefill_backend": "triton"} if linear_attention else {})
    monkeypatch.setattr(vllm_process, "flashinfer_gdn_installed", lambda: True)
    assert vllm_process.kernel_args(folder) == {}
    assert vllm_process.kernel_args(tmp_path / "not-a-checkpoint") == {}  # a hub id: vLLM's own choice


def test_an_engine_that_starts_but_cannot_answer_fails_at_start_and_is_shut_down():
    """EngineLoop.start_llm sends one one-token text request through the engine it started: an engine that built
    the model but dies at its first step (vLLM 0.26 with Qwen3.5 and no FlashInfer did) fails at start with
    EngineCannotRun and is shut down; one that answers is returned. vLLM's AsyncLLM is stood in for by the two
    calls start_llm makes of it (no vLLM on the CPU)."""
    from types import SimpleNamespace

    from vlmstream.vllm_process import START_CHECK_PROMPT, EngineCannotRun, EngineLoop

    class Engine:
        def __init__(self, fails: bool):
            self.fails, self.requests, self.shut_down = fails, [], False

        async def generate(self, prompt, params, request_id):
            self.requests.append((prompt, params.max_tokens, request_id))
            if self.fails:
                raise RuntimeError("EngineCore encountered an issue")
            yield SimpleNamespace(finished=True)

        def shutdown(self):
            self.shut_down = True

    def vllm_like(engine):
        return SimpleNamespace(
            version="0.26.0", UsageContext=SimpleNamespace(LLM_CLASS="llm_class"),
            AsyncLLM=SimpleNamespace(from_engine_args=lambda args, usage_context: engine),
            SamplingParams=lambda **kw: SimpleNamespace(**kw), RequestOutputKind=SimpleNamespace(FINAL_ONLY="final"))

    loop = EngineLoop("test-loop")
    try:
        answering = Engine(fails=False)
        assert loop.start_llm(vllm_like(answering), engine_args={}) is answering
        assert answering.requests == [(START_CHECK_PROMPT, 1, "vlmstream-start-check")]
        assert not answering.shut_down

        dying = Engine(fails=True)
        with pytest.raises(EngineCannotRun, match="failed a one-token text request at start.*EngineCore"):
            loop.start_llm(vllm_like(dying), engine_args={})
        assert dying.shut_down
    finally:
        loop.stop()


def test_a_model_whose_vllm_module_does_not_import_is_named_with_the_import_error(tmp_path, monkeypatch):
    """model_module_failure: the start error of a model whose vLLM module fails to import names that import. The
    module here is what vLLM 0.26.0's pixtral.py (imported by every LLaVA-family module) asks of the real
    transformers 5.17, which no longer has the name (seen on the H200, benchmarks/RESULTS.md [ac]); a module that
    imports, an architecture vLLM does not list, and a folder without config.json add nothing."""
    from vlmstream.vllm_process import model_module_failure

    package = tmp_path / "fake_vllm_models"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "llava_like.py").write_text(
        "from transformers.models.pixtral.modeling_pixtral import PixtralRotaryEmbedding  # noqa: F401\n")
    (package / "fine.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    models = {"LlavaLikeForConditionalGeneration": ("llava_like", "LlavaLike"), "FineModel": ("fine", "Fine")}
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlavaLikeForConditionalGeneration"]}))
    cause = model_module_failure(folder, models, package="fake_vllm_models")
    assert cause is not None and "LlavaLikeForConditionalGeneration" in cause
    assert "ImportError" in cause and "PixtralRotaryEmbedding" in cause
    for architectures in (["FineModel"], ["NotInVllm"]):
        (folder / "config.json").write_text(json.dumps({"architectures": architectures}))
        assert model_module_failure(folder, models, package="fake_vllm_models") is None
    assert model_module_failure(tmp_path / "no-config", models, package="fake_vllm_models") is None

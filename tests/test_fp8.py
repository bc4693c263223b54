"""The vision tower's FP8 option (infer.vision_fp8, consumers/infer/fp8.py): the rounding it does, and each
family's tower with its block products in FP8 against the same tower in float32, on the CPU (where the quantised
numbers are multiplied in float32: what _scaled_mm computes on the GPU, less its accumulation order)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from consumers.infer.fp8 import E4M3_MAX, fp8_weight, linear, quantize_rows
from consumers.infer.tiny_model import DEFAULT_TINY_FAMILY, write_tiny_family_model
from vlmstream.models.registry import family_of


def test_rows_are_scaled_to_e4m3s_range_and_come_back_within_its_rounding():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(64, 96, generator=generator) * torch.logspace(-3, 3, 64)[:, None]  # rows of any magnitude
    x[5] = 0.0
    quantized, scale = quantize_rows(x)
    assert quantized.dtype == torch.float8_e4m3fn and scale.shape == (64, 1)
    back = quantized.float() * scale
    assert torch.isfinite(back).all() and (back[5] == 0).all()  # a row of zeros: no division by zero
    # Each row's largest value lands on e4m3's largest; e4m3 keeps 3 mantissa bits (relative error <= 1/16 for
    # normal numbers), and values below its smallest normal lose absolute precision of at most scale * 2**-9.
    assert torch.allclose(quantized.float().abs().amax(dim=1)[x.abs().amax(dim=1) > 0], torch.tensor(E4M3_MAX))
    assert ((back - x).abs() <= x.abs() / 16 + scale * 2.0 ** -9).all()


def test_a_linear_in_fp8_is_close_to_the_exact_one_and_not_equal_to_it():
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(3, 40, 64, generator=generator)
    weight, bias = torch.randn(48, 64, generator=generator) / 8, torch.randn(48, generator=generator)
    exact = torch.nn.functional.linear(x, weight, bias)
    pair = fp8_weight(weight)
    assert isinstance(pair, tuple) and pair[0].shape == (48, 64) and pair[1].shape == (1, 48)
    out = linear(x, pair, bias)
    assert out.shape == exact.shape and out.dtype == x.dtype
    error = ((out - exact).norm() / exact.norm()).item()
    assert 1e-4 < error < 0.06  # rounded, by about e4m3's precision
    # Widths _scaled_mm cannot take stay as they are, and the product is then torch's own.
    odd = torch.randn(40, 60, generator=generator)
    assert fp8_weight(odd) is odd
    assert torch.equal(linear(x[..., :60], odd, None), torch.nn.functional.linear(x[..., :60], odd))


@pytest.mark.model
@pytest.mark.parametrize("name", [DEFAULT_TINY_FAMILY, "qwen3-vl"])
def test_each_familys_tower_in_fp8_stays_close_to_its_float_tower(tmp_path, name):
    """The tower's image_embeds (DeepStack levels included) with every block's four products in FP8, against the
    same fast blocks in float32: token by token close, not identical (FP8 ran), on weights at unit scale."""
    from consumers.infer.vision import VisionEncoder, load_vision_tower, patchify_batch
    from tests.helpers import lively
    from tests.test_families import _images

    path = write_tiny_family_model(tmp_path / name, name)
    family = family_of(path)
    tower = lively(load_vision_tower(path, "cpu", torch.float32)[0])
    pixel_values, grid_thw = patchify_batch(_images(family.factor), family=family)
    exact = torch.cat(VisionEncoder(tower, "cpu", torch.float32, attention="sdpa").encode_patches(pixel_values,
                                                                                                   grid_thw))
    encoder = VisionEncoder(tower, "cpu", torch.float32, attention="sdpa", fp8=True)
    assert encoder.fast is not None and encoder.fast.replaced == len(tower.blocks)
    out = torch.cat(encoder.encode_patches(pixel_values, grid_thw))
    cosine = torch.nn.functional.cosine_similarity(out, exact, dim=-1)
    error = ((out - exact).norm() / exact.norm()).item()
    assert cosine.min() > 0.99 and 1e-4 < error < 0.1, (cosine.min().item(), error)
    # Off again: the float blocks come back exactly.
    again = VisionEncoder(tower, "cpu", torch.float32, attention="sdpa")
    torch.testing.assert_close(torch.cat(again.encode_patches(pixel_values, grid_thw)), exact)


def test_fp8_without_the_fast_blocks_is_refused_naming_the_setting(tmp_path):
    from consumers.infer.vision import VisionEncoder, load_vision_tower

    tower, _ = load_vision_tower(write_tiny_family_model(tmp_path / "m", DEFAULT_TINY_FAMILY), "cpu", torch.float32)
    with pytest.raises(ValueError, match="infer.vision_fp8"):
        VisionEncoder(tower, "cpu", torch.float32, fast_blocks=False, fp8=True)


def test_the_compiled_block_code_traces_with_fp8_weights():
    """torch.compile (dynamic shapes, one graph) takes the FP8 pairs as it does on the GPU, and computes what the
    eager code does at two token counts."""
    from consumers.infer.mlp_activation import gelu_tanh
    from consumers.infer.vision import _after_attention

    generator = torch.Generator().manual_seed(2)
    weights = [fp8_weight(torch.randn(shape, generator=generator) / shape[1] ** 0.5)
               for shape in ((64, 64), (128, 64), (64, 128))]
    compiled = torch.compile(_after_attention, dynamic=True, fullgraph=True)
    for tokens in (50, 77):
        x, attended = torch.randn(tokens, 64, generator=generator), torch.randn(tokens, 4, 16, generator=generator)
        args = (x, attended, weights[0], None, torch.ones(64), torch.zeros(64), weights[1], None, weights[2], None,
                1e-6, gelu_tanh)
        np.testing.assert_allclose(compiled(*args).numpy(), _after_attention(*args).numpy(), rtol=1e-4, atol=1e-5)

"""FP8 matrix products for the vision tower's blocks (opt-in: ``infer.vision_fp8``).

The tower's time at 1 MP and above is mostly its four matrix products per block (q/k/v, the attention's output
projection, the MLP's two), which an H200 runs about twice as fast in FP8 (e4m3) as in bf16. Weights are scaled
per output channel once, activations per token on every call (one amax, one division and one cast, which
torch.compile fuses into the norm before the product); ``torch._scaled_mm`` multiplies the two and applies both
scales in its epilogue, in float32 accumulators, out in the activation's type.

Off CUDA the same quantised numbers are multiplied in float32 (``_reference_product``): slow, for tests that check
the rounding, never for a run. What FP8 costs in accuracy depends on the weights' own ranges; with the dummy weights
the GPU runs here it can be measured only against those (benchmarks/gpu/check_tower.py --fp8), not for a released
checkpoint.
"""

from __future__ import annotations

import torch

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
# torch._scaled_mm needs both inner and output widths in multiples of 16.
ALIGNMENT = 16


def fp8_supported(device: torch.device | str) -> bool:
    """Whether ``device`` multiplies FP8 in hardware: CUDA compute capability 8.9 (Ada) or newer."""
    device = torch.device(device)
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_problem(device: torch.device | str, dtype: torch.dtype) -> str | None:
    """Why ``linear`` cannot multiply in FP8 on ``device`` (None: it can): no FP8 in the GPU, or a torch whose
    _scaled_mm does not take per-row scales there (tried once on a small product, 20 rows: a tower's token count is
    a multiple of 4, not of 16)."""
    device = torch.device(device)
    if device.type == "cuda" and not fp8_supported(device):
        return f"{torch.cuda.get_device_name(device)} has no FP8 (compute capability 8.9 or newer)"
    try:
        x = torch.ones(20, 32, device=device, dtype=dtype)
        linear(x, fp8_weight(torch.ones(32, 32, device=device, dtype=dtype)), None)
    except Exception as exc:  # noqa: BLE001 - any failure means the option cannot run here
        return f"torch {torch.__version__} cannot multiply FP8 with per-row scales here ({type(exc).__name__}: " \
               f"{str(exc)[:200]})"
    return None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in e4m3, each row's scale as a float32 (rows, 1) column): row i is ``q[i] * scale[i]``. The scale maps the
    row's largest magnitude onto e4m3's largest value; a row of zeros keeps a tiny scale, not a division by 0."""
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def fp8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """A linear layer's (out, in) weight as (e4m3 weight, per-output-channel scales as a (1, out) row), the pair
    ``linear`` multiplies in FP8; the weight itself where its widths are not multiples of 16 (it stays bf16)."""
    if weight.dim() != 2 or weight.shape[0] % ALIGNMENT or weight.shape[1] % ALIGNMENT:
        return weight
    quantized, scale = quantize_rows(weight.detach())
    return quantized.contiguous(), scale.t().contiguous()


def linear(x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
    """``torch.nn.functional.linear``, or for a ``fp8_weight`` pair the product in FP8: x quantised per token."""
    if not isinstance(weight, tuple):
        return torch.nn.functional.linear(x, weight, bias)
    quantized, weight_scale = weight
    rows = x.reshape(-1, x.shape[-1])
    x_quantized, x_scale = quantize_rows(rows)
    if x.is_cuda:
        # The weight's transpose is column-major, as _scaled_mm wants its second operand.
        out = torch._scaled_mm(x_quantized, quantized.t(), scale_a=x_scale, scale_b=weight_scale,
                               out_dtype=x.dtype)
    else:
        out = _reference_product(x_quantized, x_scale, quantized, weight_scale).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], quantized.shape[0])


def _reference_product(x_quantized: torch.Tensor, x_scale: torch.Tensor, quantized: torch.Tensor,
                       weight_scale: torch.Tensor) -> torch.Tensor:
    """What _scaled_mm computes, in float32 on any device: the dequantised operands' product."""
    return (x_quantized.float() * x_scale) @ (quantized.float() * weight_scale.t()).t()

"""A vision block's two norms: in torch (what the fast blocks compile, and run off CUDA), and in one pass over memory
(Triton, CUDA): RMSNorm (Qwen2.5-VL) or LayerNorm (Qwen2-VL, Qwen3-VL, Qwen3.5), before the attention's projection
(``norm``) and, after the residual add, before the MLP's (``add_norm``).

Inductor compiles a reduction over more than 1,024 values per row into a loop that reads each row twice (the
threshold in ``should_use_persistent_reduction``, torch/_inductor/choices.py), and these towers' rows are 1,152 or
1,280 wide: in a 12.8 MP profile of the tower on an H200 its norm before the projection took 82 us a call
where one read and one write of its rows at the add kernel's pace would take about 50. These kernels hold a tile of
whole rows in registers, so each row is read once and written once; ``add_norm`` reads both inputs once and writes
the sum and its norm. Same arithmetic as the torch code: statistics in float32; RMSNorm rounds the normalised row to
the input type before the weight scales it (transformers'), LayerNorm applies weight and bias in float32 and rounds
once (torch's), and the residual sum is rounded to the input type before it is normalised, as torch's add is
(``add_norm``'s ``shift`` is added to that rounded sum, as a second torch add would).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from consumers.infer.vision.triton_build import built_once_where_triton_imports


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # transformers' numerics: normalise in float32, cast back, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The block's norm: LayerNorm (torch.nn.LayerNorm's own call) where it has a bias, RMSNorm where not."""
    if bias is None:
        return rms_norm(x, weight, eps)
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             eps: float, shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, its norm): the residual stream after the attention, and the MLP's input. With ``shift`` (a row) the
    residual stream returned is x + y + shift; the norm is still of x + y (the fast blocks carry the MLP's last
    bias in the stream so that the MLP's last product can add its output to it in place)."""
    total = x + y
    return (total if shift is None else total + shift), norm(total, weight, bias, eps)


def _add(a, b):
    return a + b


_add_jit = None  # _add jitted, by build_kernels


def build_kernels() -> SimpleNamespace:
    """The Triton kernels' launchers (``norm``, ``add_norm``, with the torch functions' signatures), built on first
    use (Triton is imported only where a CUDA tower runs; tests build them under TRITON_INTERPRET=1 on the CPU)."""
    import triton
    import triton.language as tl

    # The reductions' combine function is a module global, jitted here: Triton resolves a kernel's callees among
    # its globals, and tl.sum's own combine function is jitted when triton is imported, so under the interpreter
    # (tests) it fails unless TRITON_INTERPRET was set before that import.
    global _add_jit
    _add_jit = triton.jit(_add)

    @triton.jit
    def norm_kernel(x_ptr, y_ptr, total_ptr, weight_ptr, bias_ptr, shift_ptr, out_ptr, rows, eps,
                    WIDTH: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr, ADD: tl.constexpr,
                    LAYER: tl.constexpr, SHIFT: tl.constexpr):
        # One program: BLOCK_R whole rows, each read once; the statistics are sums across the tile's columns.
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)[:, None]
        c = tl.arange(0, BLOCK_W)[None, :]
        mask = (r < rows) & (c < WIDTH)
        at = r.to(tl.int64) * WIDTH + c
        x = tl.load(x_ptr + at, mask=mask, other=0.0)
        if ADD:
            x = (x.to(tl.float32) + tl.load(y_ptr + at, mask=mask, other=0.0).to(tl.float32)).to(
                x_ptr.dtype.element_ty)
            if SHIFT:
                shift = tl.load(shift_ptr + c, mask=c < WIDTH, other=0.0).to(tl.float32)
                tl.store(total_ptr + at, (x.to(tl.float32) + shift).to(x_ptr.dtype.element_ty), mask=mask)
            else:
                tl.store(total_ptr + at, x, mask=mask)
        xf = x.to(tl.float32)
        weight = tl.load(weight_ptr + c, mask=c < WIDTH, other=0.0).to(tl.float32)
        if LAYER:
            mean = tl.reduce(xf, 1, _add_jit)[:, None] / WIDTH
            centred = tl.where(mask, xf - mean, 0.0)
            variance = tl.reduce(centred * centred, 1, _add_jit)[:, None] / WIDTH
            bias = tl.load(bias_ptr + c, mask=c < WIDTH, other=0.0).to(tl.float32)
            out = centred * tl.rsqrt(variance + eps) * weight + bias
        else:
            mean_square = tl.reduce(xf * xf, 1, _add_jit)[:, None] / WIDTH
            out = weight * (xf * tl.rsqrt(mean_square + eps)).to(x_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + at, out.to(out_ptr.dtype.element_ty), mask=mask)

    def launch(x, y, weight, bias, eps, shift=None, block_elements: int = 4096):
        if y is not None and y.shape != x.shape:
            raise ValueError(f"the residual add needs two tensors of one shape, got {tuple(x.shape)} and "
                             f"{tuple(y.shape)}")
        shape, width = x.shape, x.shape[-1]
        # Rows of the last axis, packed (a copy only where the input is not already).
        x = x.reshape(-1, width).contiguous()
        y = None if y is None else y.reshape(-1, width).contiguous()
        rows = x.shape[0]
        block_w = triton.next_power_of_2(width)
        block_r = max(1, block_elements // block_w)
        out = torch.empty_like(x)
        total = torch.empty_like(x) if y is not None else out
        norm_kernel[(triton.cdiv(rows, block_r),)](
            x, x if y is None else y, total, weight, weight if bias is None else bias,
            weight if shift is None else shift, out, rows, eps, WIDTH=width, BLOCK_R=block_r, BLOCK_W=block_w,
            ADD=y is not None, LAYER=bias is not None, SHIFT=y is not None and shift is not None,
            num_warps=8 if block_r * block_w >= 4096 else 4)
        return total.view(shape), out.view(shape)

    def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
        return launch(x, None, weight, bias, eps)[1]

    def add_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 eps: float, shift: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return launch(x, y, weight, bias, eps, shift)

    return SimpleNamespace(norm=norm, add_norm=add_norm)


triton_kernels = built_once_where_triton_imports(build_kernels)

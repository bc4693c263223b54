"""q, k and v out of a vision block's fused projection, q and k rotated, in one pass over memory (Triton, CUDA).

The torch version (``rotate_qkv_torch``: unbind, ``x * cos + rotate_half(x) * sin`` in float32, ``v.contiguous()``)
compiles to two elementwise kernels that read and write the projection's output at a small fraction of the GPU's
memory bandwidth: on an H200 at 12.8 MP they took a quarter of the tower's time (1.3 ms + 0.3 ms per layer for
~30,000 patches, against 1.3 ms for the attention itself; benchmarks/gpu/bench_vision_tower.py profiles it). This
kernel reads each element of the projection once and writes q and k once, each (tokens, heads, dim) and contiguous,
as the varlen attention kernels take them. v needs no arithmetic: with ``contiguous_v=False`` it is returned as a
view of the projection (rows 3 x heads x dim apart), for an attention kernel that reads strided rows (vLLM's FA3
does), and the kernel neither reads nor writes it: a third less memory traffic. Same arithmetic as the torch version: float32,
rounded once to the input type.

``cos``/``sin`` are (tokens, dim), the tower's rotary tables for each patch; the rotation is transformers'
``rotate_half`` convention (the first half of a head's dimensions pairs with the second).
"""

from __future__ import annotations

import torch

from consumers.infer.vision.triton_build import built_once_where_triton_imports


def rotate_qkv_torch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q, k, v), each (tokens, heads, dim): the reference, and the path off CUDA. ``qkv`` is (tokens, 3, heads,
    dim); ``cos``/``sin`` (tokens, dim)."""
    q, k, v = qkv.unbind(1)
    cos, sin = cos.float().unsqueeze(-2), sin.float().unsqueeze(-2)
    return rotate(q, cos, sin), rotate(k, cos, sin), v.contiguous()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` in float32, rounded once to x's type (transformers' numerics)."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), -1)
    return (xf * cos + rotated * sin).to(x.dtype)


def build_kernel():
    """The Triton kernel, built on first use (Triton is imported only where a CUDA tower runs; tests build it under
    TRITON_INTERPRET=1 on the CPU)."""
    import triton
    import triton.language as tl

    @triton.jit
    def qkv_rotary_kernel(qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr, tokens, HEADS: tl.constexpr,
                          DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                          WRITE_V: tl.constexpr):
        # One program: BLOCK_T tokens of one head. Heads vary fastest over program ids, so the programs of one
        # token block run together and read that block's cos/sin rows from L2 rather than memory.
        head = tl.program_id(0)
        t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
        d = tl.arange(0, BLOCK_H)[None, :]
        mask = (t < tokens) & (d < HALF)
        row = t.to(tl.int64) * (3 * HEADS * DIM) + head * DIM + d
        out = t.to(tl.int64) * (HEADS * DIM) + head * DIM + d
        table = t.to(tl.int64) * DIM + d
        c1 = tl.load(cos_ptr + table, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + table + HALF, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + table, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + table + HALF, mask=mask, other=0.0).to(tl.float32)
        x1 = tl.load(qkv_ptr + row, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(qkv_ptr + row + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_ptr + out, (x1 * c1 - x2 * s1).to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(q_ptr + out + HALF, (x2 * c2 + x1 * s2).to(q_ptr.dtype.element_ty), mask=mask)
        base = row + HEADS * DIM
        x1 = tl.load(qkv_ptr + base, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(qkv_ptr + base + HALF, mask=mask, other=0.0).to(tl.float32)
        tl.store(k_ptr + out, (x1 * c1 - x2 * s1).to(k_ptr.dtype.element_ty), mask=mask)
        tl.store(k_ptr + out + HALF, (x2 * c2 + x1 * s2).to(k_ptr.dtype.element_ty), mask=mask)
        if WRITE_V:
            base = row + 2 * HEADS * DIM
            tl.store(v_ptr + out, tl.load(qkv_ptr + base, mask=mask), mask=mask)
            tl.store(v_ptr + out + HALF, tl.load(qkv_ptr + base + HALF, mask=mask), mask=mask)

    def rotate_qkv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, block_tokens: int = 64,
                   contiguous_v: bool = True):
        """(q, k, v); v a view of ``qkv`` unless ``contiguous_v`` (module docstring)."""
        tokens, three, heads, dim = qkv.shape
        if three != 3 or dim % 2 or not qkv.is_contiguous():
            raise ValueError(f"qkv must be a contiguous (tokens, 3, heads, even dim) tensor, got {tuple(qkv.shape)}")
        cos, sin = cos.contiguous(), sin.contiguous()
        q, k = (torch.empty(tokens, heads, dim, dtype=qkv.dtype, device=qkv.device) for _ in range(2))
        v = torch.empty_like(q) if contiguous_v else qkv[:, 2]
        half = dim // 2
        grid = (heads, triton.cdiv(tokens, block_tokens))
        qkv_rotary_kernel[grid](qkv, cos, sin, q, k, v, tokens, HEADS=heads, DIM=dim, HALF=half,
                                BLOCK_T=block_tokens, BLOCK_H=triton.next_power_of_2(half), WRITE_V=contiguous_v)
        return q, k, v

    return rotate_qkv


triton_rotate_qkv = built_once_where_triton_imports(build_kernel)

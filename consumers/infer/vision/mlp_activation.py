"""A vision block's MLP activation: in torch (what the fast blocks compile), and in one pass over memory (Triton,
CUDA) for the gated MLP's ``silu(gate) * up`` (Qwen2.5-VL) and the two-matrix MLP's GELU, tanh form (Qwen3-VL,
Qwen3.5), or quick GELU (Qwen2-VL).

Qwen2.5-VL's vision blocks project to gate and up in one matrix product (``block_shapes._merged_mlp``), so its
activation reads (tokens, 2 x width) and writes (tokens, width). Compiled by Inductor into the code around it, that
kernel ran at about a third of the H200's memory bandwidth: 10.9% of the tower's GPU time at 12.8 MP, more than any
kernel but the matrix products and the attention (511 us a call for 860 MB moved). ``silu_gate`` reads each tile of gate
and up once, as rows of the merged projection, and writes the tile once: alone on the H200 it moved 4.1 TB/s against the
compiled kernel's 1.7, 2.4 times as fast, with the same output bit for bit (benchmarks/gpu/bench_mlp_activation.py). The
one-input activations are one flat pass each: 2.0 times (GELU, tanh form) and 1.8 times (quick GELU) as fast as
Inductor's kernels there. Same arithmetic as the compiled code: float32, rounded once to the input type (GELU's tanh as
1 - 2 / (exp(2y) + 1), within float32 rounding of tanh).
"""

from __future__ import annotations

from types import SimpleNamespace

import torch

from consumers.infer.vision.triton_build import built_once_where_triton_imports


# The activations in torch, which the fast blocks compile (and run off CUDA), and the kernels' references. Module-level
# functions, one object per kind, so that the compiled code is shared by every block (block_shapes._activation_of).


def silu_gate(gate_up: torch.Tensor) -> torch.Tensor:
    """Qwen2.5-VL's gated MLP on the merged gate/up projection: ``silu(gate) * up``, gate the first half of the last
    axis and up the second."""
    gate, up = gate_up.chunk(2, -1)
    return torch.nn.functional.silu(gate) * up


def gelu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.gelu(x, approximate="tanh")


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x)


GELU_TANH, QUICK_GELU = 0, 1  # the flat kernel's activations


def build_kernels() -> SimpleNamespace:
    """The Triton kernels' launchers (``silu_gate``, ``gelu_tanh``, ``quick_gelu``), built on first use (Triton is
    imported only where a CUDA tower runs; tests build them under TRITON_INTERPRET=1 on the CPU)."""
    import triton
    import triton.language as tl

    @triton.jit
    def silu_gate_kernel(gate_up_ptr, out_ptr, tokens, WIDTH: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_W: tl.constexpr):
        # One program: BLOCK_T rows by BLOCK_W columns of the output. Within a row the columns are contiguous in
        # gate, in up and in the output, so every load and store moves whole 16-byte vectors.
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
        w = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)[None, :]
        mask = (t < tokens) & (w < WIDTH)
        row = t.to(tl.int64) * (2 * WIDTH) + w
        gate = tl.load(gate_up_ptr + row, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row + WIDTH, mask=mask, other=0.0).to(tl.float32)
        out = gate / (1.0 + tl.exp(-gate)) * up
        tl.store(out_ptr + t.to(tl.int64) * WIDTH + w, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def activation_kernel(x_ptr, out_ptr, n, KIND: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        x = tl.load(x_ptr + i, mask=mask, other=0.0).to(tl.float32)
        if KIND == 0:  # GELU_TANH: 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3)))
            y = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            out = 0.5 * x * (2.0 - 2.0 / (tl.exp(2.0 * y) + 1.0))
        else:  # QUICK_GELU: x sigmoid(1.702 x)
            out = x / (1.0 + tl.exp(-1.702 * x))
        tl.store(out_ptr + i, out.to(out_ptr.dtype.element_ty), mask=mask)

    def silu_gate(gate_up: torch.Tensor, block_tokens: int = 16, block_width: int = 128) -> torch.Tensor:
        if gate_up.dim() != 2 or gate_up.shape[1] % 2 or not gate_up.is_contiguous():
            raise ValueError(f"gate_up must be a contiguous (tokens, 2 x width) tensor, got {tuple(gate_up.shape)}")
        tokens, width = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(tokens, width, dtype=gate_up.dtype, device=gate_up.device)
        grid = (triton.cdiv(tokens, block_tokens), triton.cdiv(width, block_width))
        silu_gate_kernel[grid](gate_up, out, tokens, WIDTH=width, BLOCK_T=block_tokens, BLOCK_W=block_width)
        return out

    def flat(kind: int):
        def activation(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
            if not x.is_contiguous():
                raise ValueError(f"the activation's input must be contiguous, got strides {x.stride()}")
            out = torch.empty_like(x)
            activation_kernel[(triton.cdiv(x.numel(), block),)](x, out, x.numel(), KIND=kind, BLOCK=block)
            return out

        return activation

    return SimpleNamespace(silu_gate=silu_gate, gelu_tanh=flat(GELU_TANH), quick_gelu=flat(QUICK_GELU))


triton_kernels = built_once_where_triton_imports(build_kernels)

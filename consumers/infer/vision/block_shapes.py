"""What the fast blocks (``blocks.py``) need of a tower's block, and the MLP weights they run on.

transformers' MLP width is often not a multiple of 64 (3420 for Qwen2.5-VL-7B's tower, 4304 for Qwen3-VL-8B's), so
cuBLAS falls back to slower GEMM kernels (52% of a 1 MP Qwen2.5-VL forward on an H200). The fast blocks compute the
same function with the MLP's first projection (Qwen2.5-VL: gate and up merged into one GEMM) zero-padded to a
multiple of 64: the padded columns come out of the activation as zeros, and zero columns of the second projection add
nothing. Two block shapes fit: RMSNorm + gated SiLU MLP (Qwen2.5-VL) and LayerNorm + two-matrix MLP (Qwen2-VL,
Qwen3-VL dense and MoE, Qwen3.5's vision part); any other keeps transformers' forward. The module's own parameters
stay as they are (state dicts and checkpoints unchanged); the padded copies live beside them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from consumers.infer.vision.mlp_activation import gelu, gelu_tanh, quick_gelu, silu, silu_gate


GEMM_ALIGNMENT = 64


def _activation_of(act: torch.nn.Module):
    """The module-level function computing a two-matrix MLP's activation module, or None for one not known here.
    One function object per kind, so the compiled code is shared by every block (a module instance would be
    guarded on and recompiled per block)."""
    from transformers import activations

    if type(act) is torch.nn.GELU:
        return gelu_tanh if act.approximate == "tanh" else gelu
    return {activations.GELUTanh: gelu_tanh, activations.GELUActivation: gelu,
            activations.QuickGELUActivation: quick_gelu, activations.SiLUActivation: silu,
            torch.nn.SiLU: silu}.get(type(act))


def _padded(width: int, alignment: int) -> int:
    return -(-width // alignment) * alignment


def _merged_mlp(mlp: torch.nn.Module, alignment: int = GEMM_ALIGNMENT):
    """(gate/up weight, its bias, down weight) of a gated MLP, each half padded with zeros to the alignment:
    the padded gate and up columns are both 0, and silu(0) * 0 = 0."""
    width = mlp.gate_proj.out_features
    padded = _padded(width, alignment)
    hidden = mlp.gate_proj.in_features
    like = mlp.gate_proj.weight
    gate_up_weight = torch.zeros(2 * padded, hidden, dtype=like.dtype, device=like.device)
    gate_up_weight[:width] = mlp.gate_proj.weight
    gate_up_weight[padded:padded + width] = mlp.up_proj.weight
    gate_up_bias = None
    if mlp.gate_proj.bias is not None:
        gate_up_bias = torch.zeros(2 * padded, dtype=like.dtype, device=like.device)
        gate_up_bias[:width] = mlp.gate_proj.bias
        gate_up_bias[padded:padded + width] = mlp.up_proj.bias
    down_weight = torch.zeros(mlp.down_proj.out_features, padded, dtype=like.dtype, device=like.device)
    down_weight[:, :width] = mlp.down_proj.weight
    return gate_up_weight, gate_up_bias, down_weight


def padded_mlp(fc1: torch.nn.Linear, fc2: torch.nn.Linear, activation, alignment: int = GEMM_ALIGNMENT):
    """(fc1 weight, its bias, fc2 weight) of a two-matrix MLP, fc1's outputs padded with zero rows (weight and
    bias) to the alignment and fc2's inputs with zero columns. Only where activation(0) == 0: a padded column
    then reaches fc2 as 0. For any other activation the unpadded weights themselves."""
    width = fc1.out_features
    padded = _padded(width, alignment)
    zero = torch.zeros(1, dtype=fc1.weight.dtype, device=fc1.weight.device)
    if padded == width or activation(zero).item() != 0:
        return fc1.weight, fc1.bias, fc2.weight
    like = fc1.weight
    up_weight = torch.zeros(padded, fc1.in_features, dtype=like.dtype, device=like.device)
    up_weight[:width] = fc1.weight
    up_bias = None
    if fc1.bias is not None:
        up_bias = torch.zeros(padded, dtype=like.dtype, device=like.device)
        up_bias[:width] = fc1.bias
    down_weight = torch.zeros(fc2.out_features, padded, dtype=like.dtype, device=like.device)
    down_weight[:, :width] = fc2.weight
    return up_weight, up_bias, down_weight


@dataclass(frozen=True, eq=False)
class BlockShape:
    """What the fused forward needs of one block: its norms' biases (None: RMSNorm), its MLP's two projections
    (weights padded), the activation between them and the MLP's second bias."""
    norm_eps: float
    norm1_bias: torch.Tensor | None
    norm2_bias: torch.Tensor | None
    mlp: tuple  # (first weight, first bias, second weight)
    down_bias: torch.Tensor | None
    activation: object


def block_shape(block: torch.nn.Module, alignment: int) -> BlockShape | str:
    """The fused forward's view of a block, or why the block has a shape the fused forward does not compute."""
    attn, mlp = getattr(block, "attn", None), getattr(block, "mlp", None)
    norm1, norm2 = getattr(block, "norm1", None), getattr(block, "norm2", None)
    if not all(isinstance(getattr(attn, name, None), torch.nn.Linear) for name in ("qkv", "proj")) \
            or not hasattr(attn, "num_heads") or not hasattr(attn, "scaling"):
        return "its attention has no qkv/proj projections"
    if isinstance(norm1, torch.nn.LayerNorm) and isinstance(norm2, torch.nn.LayerNorm):
        if norm1.bias is None or norm2.bias is None or norm1.eps != norm2.eps or len(norm1.normalized_shape) != 1:
            return "its LayerNorms have no bias or differ in eps"
        eps, biases = norm1.eps, (norm1.bias, norm2.bias)
    elif all(hasattr(n, "variance_epsilon") and isinstance(getattr(n, "weight", None), torch.nn.Parameter)
             and getattr(n, "bias", None) is None for n in (norm1, norm2)):
        if norm1.variance_epsilon != norm2.variance_epsilon:
            return "its RMSNorms differ in eps"
        eps, biases = norm1.variance_epsilon, (None, None)
    else:
        return f"its norms are {type(norm1).__name__}/{type(norm2).__name__}"

    cached = getattr(block, "_vlmstream_mlp", None)
    if all(isinstance(getattr(mlp, name, None), torch.nn.Linear) for name in ("gate_proj", "up_proj", "down_proj")):
        if _activation_of(mlp.act_fn) is not silu:
            return f"its gated MLP's activation is {type(mlp.act_fn).__name__}, not SiLU"
        if cached is None or cached[0] != alignment:
            block._vlmstream_mlp = cached = (alignment, _merged_mlp(mlp, alignment))
        return BlockShape(eps, *biases, cached[1], mlp.down_proj.bias, silu_gate)
    for first, act_name, second in (("fc1", "act", "fc2"), ("linear_fc1", "act_fn", "linear_fc2")):
        fc1, fc2 = getattr(mlp, first, None), getattr(mlp, second, None)
        if isinstance(fc1, torch.nn.Linear) and isinstance(fc2, torch.nn.Linear):
            activation = _activation_of(getattr(mlp, act_name, None))
            if activation is None:
                return f"its MLP's activation {type(getattr(mlp, act_name, None)).__name__} is not known here"
            if cached is None or cached[0] != alignment:
                block._vlmstream_mlp = cached = (alignment, padded_mlp(fc1, fc2, activation, alignment))
            return BlockShape(eps, *biases, cached[1], fc2.bias, activation)
    return f"its MLP ({type(mlp).__name__}) has neither gate/up/down nor fc1/fc2 projections"

"""Pixel preprocessing and the vision tower of the Qwen families, run on the target device (each family's numbers:
vlmstream/models/qwen2_vl.py, qwen3_vl.py, qwen3_5.py).

vLLM's front end normalises and patchifies every image on one CPU core (209 ms for a 12.8 MP image);
here the uint8 pixels travel to the GPU as they are (a quarter of the float bytes) and are rescaled,
normalised and cut into patches there, in exactly the layout transformers' Qwen2VLImageProcessor
produces with ``do_resize=False`` (every Qwen family uses it, with its own patch size and normalisation).
The encoder batches several images into one varlen forward.

What the encoder returns per image is the family's ``image_embeds``: the main merger's tokens, and for Qwen3-VL
the DeepStack levels' tokens concatenated after them on the feature axis (``ModelFamily.image_embeds_width``). The
embedding for the embeddings topic is the mean of the main merger's part (``ModelFamily.embedding_width``).
"""

from __future__ import annotations

import collections
import functools
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from torch.nn.functional import linear

from consumers.infer.block_norm import add_norm, norm
from consumers.infer.block_norm import triton_kernels as triton_norm_kernels
from consumers.infer.mlp_activation import gelu, gelu_tanh, quick_gelu, silu, silu_gate
from consumers.infer.mlp_activation import triton_kernels as triton_mlp_kernels
from consumers.infer.qkv_rotary import rotate, triton_rotate_qkv
from vlmstream.models.family import ModelFamily
from vlmstream.models.qwen2_vl import QWEN2_VL

try:  # transformers 5: the vision forward takes its index tensors precomputed (VisionEncoder._index_inputs)
    from transformers import vision_utils as _vision_utils
except ImportError:  # older transformers derives them itself
    _vision_utils = None

log = logging.getLogger(__name__)


class PixelNormalizer:
    """Rescale (1/255) and normalise (the family's mean/std: CLIP's) folded into one multiply-add per channel."""

    def __init__(self, device: torch.device | str, mean: Sequence[float] = QWEN2_VL.image_mean,
                 std: Sequence[float] = QWEN2_VL.image_std):
        std_t = torch.tensor(std, dtype=torch.float32, device=device)
        mean_t = torch.tensor(mean, dtype=torch.float32, device=device)
        self.scale = (1.0 / (255.0 * std_t)).view(1, 3, 1, 1, 1)
        self.bias = (-mean_t / std_t).view(1, 3, 1, 1, 1)
        self.device = torch.device(device)


_normalizers: dict[tuple, PixelNormalizer] = {}


def _normalizer(device: torch.device, family: ModelFamily) -> PixelNormalizer:
    key = (str(device), family.image_mean, family.image_std)
    if key not in _normalizers:
        _normalizers[key] = PixelNormalizer(device, family.image_mean, family.image_std)
    return _normalizers[key]


_pinning = True  # until the host refuses page-locked memory once


def _page_locked(make):
    """``make()``, which allocates page-locked memory, or None where the host refuses it: said once, and never
    asked again, so that copies get slower rather than batches failing."""
    global _pinning
    if not _pinning:
        return None
    try:
        return make()
    except RuntimeError as exc:
        _pinning = False
        log.warning("page-locked memory unavailable (%s); copies between host and GPU wait for the GPU from now on",
                    exc)
        return None


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device`` without making this thread wait for the GPU. From pageable memory a copy to the
    GPU is synchronous: it waits until the stream has finished everything queued before it, so each image or index
    tensor sent before a forward left the GPU idle while this thread prepared the next batch. Staged in page-locked
    memory first (torch's caching host allocator keeps the block until the copy is done), the copy is queued and
    this thread goes on."""
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    staged = tensor if tensor.is_pinned() else _page_locked(tensor.pin_memory)
    if staged is None:
        return tensor.to(device)
    return staged.to(device, non_blocking=True)


def grid_for(height: int, width: int, family: ModelFamily = QWEN2_VL) -> tuple[int, int, int]:
    factor = family.factor
    if height % factor or width % factor:
        raise ValueError(f"image {width}x{height} is not a multiple of {factor} px: "
                         "resize it with smart_resize before inference")
    return family.grid_thw(height, width)


def patchify(image: np.ndarray | torch.Tensor, device: torch.device | str = "cpu",
             dtype: torch.dtype = torch.float32,
             family: ModelFamily = QWEN2_VL) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One H x W x 3 uint8 RGB image -> (pixel_values (gh*gw, 3*T*p*p), grid (1, gh, gw)), p and T the family's
    patch and temporal patch sizes (14 and 2 for Qwen2/2.5-VL, 16 and 2 for Qwen3-VL and Qwen3.5).

    Patch order and feature order match Qwen2VLImageProcessor: merge-window-major rows
    (gh/2, gw/2, 2, 2) and features (channel, temporal, patch_y, patch_x), the single frame duplicated
    over the temporal axis.
    """
    device = torch.device(device)
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"expected an H x W x 3 uint8 array, got {image.dtype} {image.shape}")
        pixels = torch.from_numpy(np.ascontiguousarray(image))
    else:
        pixels = image
    height, width = int(pixels.shape[0]), int(pixels.shape[1])
    _, grid_h, grid_w = grid_for(height, width, family)
    # Move uint8, not float: 4x fewer bytes over PCIe, and the layout shuffle below copies bytes, not floats.
    pixels = to_device(pixels, device)
    p, m, frames = family.patch_size, family.merge_size, family.temporal_patch_size
    blocks = (pixels.view(grid_h // m, m, p, grid_w // m, m, p, 3)
              .permute(0, 3, 1, 4, 6, 2, 5)  # (gh/m, gw/m, m, m, channel, p, p)
              .reshape(grid_h * grid_w, 3, 1, p, p))
    normalizer = _normalizer(device, family)
    values = blocks.to(torch.float32).mul_(normalizer.scale).add_(normalizer.bias)
    values = values.expand(-1, -1, frames, -1, -1).to(dtype)
    return values.reshape(grid_h * grid_w, 3 * frames * p * p), (1, grid_h, grid_w)


def patchify_batch(images: Sequence[np.ndarray], device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32,
                   family: ModelFamily = QWEN2_VL) -> tuple[torch.Tensor, torch.Tensor]:
    """Several images -> concatenated pixel_values (on device) and their (n, 3) grid_thw, as the processor returns
    them. The grid stays on the CPU: the encoder derives its index tensors from it there (encode_patches)."""
    parts, grids = zip(*(patchify(image, device, dtype, family) for image in images))
    return torch.cat(parts), torch.tensor(grids, dtype=torch.long)


# ---------------------------------------------------------------------------------------------------------
# Attention for the vision blocks. transformers sends a packed varlen call (cu_seqlens over windows and
# images) to any registered implementation whose name contains "flash"; its sdpa path instead loops in
# Python over every window of every image. On CUDA we register vLLM's FlashAttention 3 (what vLLM's own
# tower runs) or torch's built-in varlen flash attention under such names.
# ---------------------------------------------------------------------------------------------------------

VLLM_FA3 = "vlmstream_flash_vllm_fa3"
TORCH_VARLEN = "vlmstream_flash_torch_varlen"


def _varlen_adapter(kernel):
    def attention(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0,
                  cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **_):
        # transformers hands (1, heads, tokens, head_dim); varlen kernels take (tokens, heads, head_dim).
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))
        cu_q = cu_seq_lens_q.to(torch.int32)
        cu_k = cu_seq_lens_k.to(torch.int32)
        out = kernel(q, k, v, cu_q, cu_k, int(max_length_q), int(max_length_k), scaling)
        return out.unsqueeze(0), None

    return attention


def _vllm_fa3_kernel():
    from vllm.vllm_flash_attn.flash_attn_interface import flash_attn_varlen_func, is_fa_version_supported

    if not is_fa_version_supported(3):
        raise RuntimeError("vLLM's FlashAttention 3 is not supported on this device")

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        # fa_version is explicit: vLLM's default is FA2, whose library the device bundle leaves out.
        return flash_attn_varlen_func(q, k, v, max_seqlen_q=max_q, cu_seqlens_q=cu_q, max_seqlen_k=max_k,
                                      cu_seqlens_k=cu_k, softmax_scale=scale, causal=False, fa_version=3)

    return kernel


def _torch_varlen_kernel():
    from torch.nn.attention.varlen import varlen_attn

    def kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        return varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale)

    return kernel


# Raw kernels by registered name, for the fast blocks (which call them without transformers' adapter).
VARLEN_KERNELS: dict = {}


def _register(name: str, kernel_factory) -> bool:
    from transformers import AttentionInterface

    if name in AttentionInterface._global_mapping and name in VARLEN_KERNELS:
        return True
    try:
        kernel = kernel_factory()
        AttentionInterface.register(name, _varlen_adapter(kernel))
        VARLEN_KERNELS[name] = kernel
        return True
    except Exception as exc:  # missing package, unsupported GPU: the next candidate is tried
        log.info("vision attention %s unavailable: %s", name, exc)
        return False


def _probe(name: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Run the kernel once on a tiny packed batch and compare it with sdpa: a kernel that imports but
    cannot run on this GPU (wrong arch, missing library) must not be picked."""
    from transformers import AttentionInterface

    try:
        fn = AttentionInterface._global_mapping[name]
        gen = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(1, 2, 48, 64, generator=gen).to(device, dtype) for _ in range(3))
        cu = torch.tensor([0, 16, 48], dtype=torch.int32, device=device)
        out, _ = fn(None, q, k, v, scaling=0.125, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=32, max_length_k=32)
        ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=0.125).transpose(1, 2) for a, b in ((0, 16), (16, 48))], 1)
        return bool(torch.allclose(out.float(), ref.float(), atol=2e-2, rtol=2e-2))
    except Exception as exc:
        log.info("vision attention %s failed its probe: %s", name, exc)
        return False


_STRIDED_V: dict = {}  # takes_strided_v's answers by (kernel, device, dtype)


def takes_strided_v(name: str, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether the registered varlen kernel ``name`` gives the same output with v a view of a packed (tokens, 3,
    heads, dim) projection as with v contiguous: then the fast blocks hand it that view and the q/k/v kernel skips
    copying v. Tried once per kernel, device and dtype; an error or another output says no."""
    key = (name, str(device), dtype)
    if key not in _STRIDED_V:
        try:
            kernel = VARLEN_KERNELS[name]
            gen = torch.Generator(device="cpu").manual_seed(0)
            qkv = torch.randn(48, 3, 2, 64, generator=gen).to(device, dtype)
            q, k, v = (qkv[:, i].contiguous() for i in range(3))
            cu = torch.tensor([0, 16, 48], dtype=torch.int32, device=device)
            # Close, not equal: a kernel may take another path for other strides; one that misreads them is off
            # by the values' own size.
            _STRIDED_V[key] = bool(torch.allclose(kernel(q, k, qkv[:, 2], cu, cu, 32, 32, 0.125).float(),
                                                  kernel(q, k, v, cu, cu, 32, 32, 0.125).float(), atol=1e-2, rtol=1e-2))
        except Exception as exc:  # noqa: BLE001 - the blocks then copy v, as for any kernel that needs it
            log.info("vision attention %s does not take a strided v: %s", name, exc)
            _STRIDED_V[key] = False
    return _STRIDED_V[key]


def pick_vision_attention(device: torch.device | str, dtype: torch.dtype, requested: str = "auto") -> str:
    """The fastest attention available for the vision blocks: vLLM FA3 > torch varlen flash > sdpa.
    Flash kernels need CUDA and half precision; on CPU it is sdpa."""
    device = torch.device(device)
    candidates = {"vllm_fa3": (VLLM_FA3, _vllm_fa3_kernel), "torch_varlen": (TORCH_VARLEN, _torch_varlen_kernel)}
    if requested in ("sdpa", "eager"):
        return requested
    if requested != "auto":
        name, factory = candidates[requested]
        if not (_register(name, factory) and _probe(name, device, dtype)):
            raise RuntimeError(f"vision attention {requested!r} is not usable on {device}")
        return name
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return "sdpa"
    for name, factory in candidates.values():
        if _register(name, factory) and _probe(name, device, dtype):
            return name
    return "sdpa"


def pick_window_attention(device: torch.device | str, dtype: torch.dtype, attention: str) -> str | None:
    """The kernel for a windowed tower's window blocks (Qwen2.5-VL's: thousands of 64-patch windows per image), or
    None for the tower's own ``attention`` there too: torch's varlen flash attention (FlashAttention 2) on CUDA in
    half precision where the whole-image blocks have a varlen kernel and it passes its probe, since on an H200 its
    packed call over 64-patch windows ran 1.6 times as fast as vLLM's FA3, which wins on whole images, and the tower
    ran 3-4% faster with it at 1 and 12.8 MP (benchmarks/gpu/bench_vision_tower.py); elsewhere None."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or attention not in VARLEN_KERNELS:
        return None
    try:
        return pick_vision_attention(device, dtype, "torch_varlen")
    except RuntimeError as exc:
        log.info("window blocks keep %s: %s", attention, exc)
        return None


class PatchProjection(torch.nn.Module):
    """The patch embedding's Conv3d as the matrix product it is.

    Its kernel equals its stride and covers the whole (channel, frame, 14, 14) patch, so the convolution is one
    GEMM. With torch 2.9 cuDNN had no fast bf16 algorithm for that shape and the Conv3d dominated whole towers
    (pytorch/pytorch#174051; vLLM's Conv3dLayer does the same substitution). On the device's torch 2.11 both
    run at the same speed (benchmarks/gpu/bench_vision_tower.py); the swap guards other versions.
    The Parameter is the convolution's own, so its state-dict key and
    shape are unchanged and weights load before or after the swap.
    """

    def __init__(self, conv: torch.nn.Conv3d):
        super().__init__()
        if tuple(conv.kernel_size) != tuple(conv.stride) or conv.padding != (0, 0, 0):
            raise ValueError("only a Conv3d whose kernel equals its stride is a plain matrix product")
        self.weight = conv.weight
        # Qwen3-VL's patch embedding has a bias, Qwen2.5-VL's has none.
        self.bias = conv.bias
        self.out_channels = conv.out_channels

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        # (patches, C, T, P, P) -> (patches, out_channels); the caller's view(-1, embed_dim) accepts either shape.
        flat = patches.reshape(patches.shape[0], -1)
        return torch.nn.functional.linear(flat, self.weight.view(self.out_channels, -1), self.bias)


def use_linear_patch_embedding(visual: torch.nn.Module) -> torch.nn.Module:
    """Swap the tower's patch-embedding Conv3d for ``PatchProjection`` (idempotent); returns the tower."""
    embed = getattr(visual, "patch_embed", None)
    if embed is not None and isinstance(getattr(embed, "proj", None), torch.nn.Conv3d):
        embed.proj = PatchProjection(embed.proj)
    return visual


# ---------------------------------------------------------------------------------------------------------
# Fast vision blocks. transformers' block is correct but slow on a GPU: its MLP width is often not a multiple
# of 64 (3420 for Qwen2.5-VL-7B's tower, 4304 for Qwen3-VL-8B's), so cuBLAS falls back to slower GEMM kernels
# (52% of a 1 MP Qwen2.5-VL forward on an H200), and the norms, rotary and activation
# run as ~20 separate float32 elementwise kernels per layer (a further third). The replacement computes the
# same function: the MLP's first projection (Qwen2.5-VL: gate and up merged into one GEMM) zero-padded to a
# multiple of 64 (the padded columns come out of the activation as zeros, and zero columns of the second
# projection add nothing), the attention kernel called directly on (tokens, heads, dim), and on CUDA the code
# around the attention compiled by torch.compile so the elementwise work fuses. Two block shapes fit: RMSNorm +
# gated SiLU MLP (Qwen2.5-VL) and LayerNorm + two-matrix MLP (Qwen2-VL, Qwen3-VL dense and MoE, Qwen3.5's
# vision part); any other keeps transformers' forward. The module's own parameters stay as they are (state
# dicts and checkpoints unchanged); the padded copies live beside them.
# ---------------------------------------------------------------------------------------------------------

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


def _before_attention(x, norm_weight, norm_bias, qkv_weight, qkv_bias, cos, sin, eps: float, heads: int):
    h = norm(x, norm_weight, norm_bias, eps)
    q, k, v = linear(h, qkv_weight, qkv_bias).view(x.shape[0], 3, heads, -1).unbind(1)
    return rotate(q, cos, sin), rotate(k, cos, sin), v.contiguous()


def _project(x, norm_weight, norm_bias, qkv_weight, qkv_bias, eps: float):
    return linear(norm(x, norm_weight, norm_bias, eps), qkv_weight, qkv_bias)


def _after_attention(x, attended, proj_weight, proj_bias, norm_weight, norm_bias, up_weight, up_bias,
                     down_weight, down_bias, eps: float, activation):
    x, h = _up_projection(x, attended, proj_weight, proj_bias, norm_weight, norm_bias, up_weight, up_bias, eps)
    return x + linear(activation(h), down_weight, down_bias)


def _up_projection(x, attended, proj_weight, proj_bias, norm_weight, norm_bias, up_weight, up_bias, eps: float,
                   residual_bias=None):
    """The block after its attention up to the MLP's activation: (residual stream, the MLP's first projection).
    ``residual_bias`` (the MLP's last bias, for ``_add_down_projection``) is added to the residual stream that is
    returned, not to what the norm reads."""
    x = x + linear(attended.reshape(x.shape[0], -1), proj_weight, proj_bias)
    h = linear(norm(x, norm_weight, norm_bias, eps), up_weight, up_bias)
    return (x if residual_bias is None else x + residual_bias), h


def _add_down_projection(residual: torch.Tensor, activated: torch.Tensor, down_weight) -> torch.Tensor:
    """``residual + activated @ down_weight.T``, the block's last residual add done by the product itself: cuBLAS
    adds its output to ``residual`` in place (beta = 1), so the sum costs no pass of its own over the rows (a product
    and then an add write the product's rows and read them back). ``residual`` must be a tensor nothing else reads:
    the up step's fresh output, with the MLP's last bias already in it."""
    return residual.addmm_(activated, down_weight.t())


def _steps_with_norm_kernels(kernels):
    """``_project`` and ``_up_projection`` with the blocks' norms run by the Triton kernels (``block_norm.py``):
    what is left of them are matrix products, cuBLAS calls with nothing to compile."""

    def project(x, norm_weight, norm_bias, qkv_weight, qkv_bias, eps: float):
        return linear(kernels.norm(x, norm_weight, norm_bias, eps), qkv_weight, qkv_bias)

    def up_projection(x, attended, proj_weight, proj_bias, norm_weight, norm_bias, up_weight, up_bias, eps: float,
                      residual_bias=None):
        x, normed = kernels.add_norm(x, linear(attended.reshape(x.shape[0], -1), proj_weight, proj_bias),
                                     norm_weight, norm_bias, eps, shift=residual_bias)
        return x, linear(normed, up_weight, up_bias)

    return project, up_projection


def _norm_kernels_agree(kernels, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> bool:
    """The Triton norms against torch's on random rows of a block's width, dtype and device, once per tower (as the
    attention kernels are probed): a kernel that fails, or answers more than bf16 rounding apart, is not used."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    x, y = (torch.randn(64, weight.shape[0], generator=gen).to(weight.device, weight.dtype) for _ in range(2))
    with torch.inference_mode():
        try:
            got = (kernels.norm(x, weight, bias, eps), *kernels.add_norm(x, y, weight, bias, eps))
        except Exception as exc:  # noqa: BLE001 - an optimisation must never stop the engine
            log.info("the Triton norm kernels failed their probe: %s", exc)
            return False
        want = (norm(x, weight, bias, eps), *add_norm(x, y, weight, bias, eps))
    return all(bool((g.float() - w.float()).abs().max() <= 0.02 * w.float().abs().max() + 1e-3)
               for g, w in zip(got, want))


def _windowed_sdpa(q, k, v, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention within each [cu[i], cu[i+1]) window, for devices without a varlen kernel (CPU)."""
    bounds = cu_seqlens.tolist()
    out = torch.empty_like(q)
    for start, end in zip(bounds[:-1], bounds[1:]):
        # 4-D (1, heads, tokens, dim): with 3-D input torch takes its slow math path on CPU.
        window = [t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(*window, scale=scale)[0].transpose(0, 1)
    return out


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


def _padded_mlp(fc1: torch.nn.Linear, fc2: torch.nn.Linear, activation, alignment: int = GEMM_ALIGNMENT):
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
class _BlockShape:
    """What the fused forward needs of one block: its norms' biases (None: RMSNorm), its MLP's two projections
    (weights padded), the activation between them and the MLP's second bias."""
    norm_eps: float
    norm1_bias: torch.Tensor | None
    norm2_bias: torch.Tensor | None
    mlp: tuple  # (first weight, first bias, second weight)
    down_bias: torch.Tensor | None
    activation: object


def _block_shape(block: torch.nn.Module, alignment: int) -> _BlockShape | str:
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
        return _BlockShape(eps, *biases, cached[1], mlp.down_proj.bias, silu_gate)
    for first, act_name, second in (("fc1", "act", "fc2"), ("linear_fc1", "act_fn", "linear_fc2")):
        fc1, fc2 = getattr(mlp, first, None), getattr(mlp, second, None)
        if isinstance(fc1, torch.nn.Linear) and isinstance(fc2, torch.nn.Linear):
            activation = _activation_of(getattr(mlp, act_name, None))
            if activation is None:
                return f"its MLP's activation {type(getattr(mlp, act_name, None)).__name__} is not known here"
            if cached is None or cached[0] != alignment:
                block._vlmstream_mlp = cached = (alignment, _padded_mlp(fc1, fc2, activation, alignment))
            return _BlockShape(eps, *biases, cached[1], fc2.bias, activation)
    return f"its MLP ({type(mlp).__name__}) has neither gate/up/down nor fc1/fc2 projections"


# Inductor compiles in this process, not in its pool of compile workers. A process's first Triton compile starts that
# pool, one worker per core (16 on the H200 host), and the tower timed right after its compile then ran three times
# slower at 0.2 MP (9.8 against 3.1 ms per image) with every core of the host busy: at that
# budget the tower is bound by the one thread that launches its kernels. Compiled in this process it ran at full speed
# from its first pass, and compiled no slower. The option holds for every later recompile of these functions too.
IN_PROCESS_COMPILE = {"compile_threads": 1}


def compiled_in_process(fn):
    """``fn`` compiled by torch.compile for any tensor sizes, as one graph, Inductor compiling in this process."""
    return torch.compile(fn, dynamic=True, fullgraph=True, options=IN_PROCESS_COMPILE)


_reported_shapes: set[str] = set()


class FastVisionBlocks:
    """Replaces the ``forward`` of every block of a Qwen vision tower whose shape it knows (``_block_shape``:
    Qwen2.5-VL's RMSNorm + gated MLP, or the LayerNorm + two-matrix MLP of Qwen2-VL, Qwen3-VL and Qwen3.5) with
    the fused version above; any other block keeps transformers' forward (said once at info). ``replaced`` counts
    the blocks it took over.

    The forward is the block's own call target, so the tower's forward still calls ``block(...)`` for each block in
    turn and still takes the DeepStack levels (Qwen3-VL) from the hidden states between blocks.

    ``attention`` is a varlen kernel ``(q, k, v, cu_q, cu_k, max_q, max_k, scale) -> out`` on (tokens, heads,
    dim) tensors, or None for the per-window sdpa loop. ``compile_blocks`` compiles the code around the
    attention (CUDA only; a failed compile falls back to eager with a warning).

    Compiled blocks also run the Triton kernels, where Triton imports (on an H200 each ran faster than Inductor's code
    for the same step, the tower faster with them: benchmarks/gpu/bench_vision_tower.py and the kernels' own
    benchmarks in benchmarks/gpu/): q, k, v split out of the projection and rotated in one pass (``qkv_rotary.py``);
    the MLP's activation in one pass (``mlp_activation.py``, between a
    compiled call for the code before it and the down projection: a gated MLP's ``silu(gate) * up``, GELU in its
    tanh form, quick GELU; any other activation keeps the compiled code); and the two norms in one pass over whole
    rows in the steps beside those kernels (``block_norm.py``; probed once against torch's norm on the tower's width,
    dtype and device, and dropped with a warning if they disagree). ``triton``: None decides so; True runs the
    kernels without compiling too, which tests do on the CPU through Triton's interpreter (an error where Triton does
    not import). Without the kernels each step is the compiled (or eager) torch code.
    ``strided_v``: the Triton q/k/v kernel leaves v as a view of the projection (``qkv_rotary.py``); only for an
    attention that reads it so (``takes_strided_v``; the per-window sdpa loop does).
    ``residual_in_product``: where the MLP's activation has a Triton kernel, its last product adds its output to the
    residual stream in place (``_add_down_projection``) instead of a separate add after it; False only to measure
    what that is worth.
    ``window_attention``: the varlen kernel for the blocks of a windowed tower (Qwen2.5-VL) that attend within
    windows, not over whole images (the blocks outside ``fullatt_block_indexes``); None: ``attention`` for those too.
    A kernel built for long sequences need not be the fastest on thousands of 64-patch windows.
    """

    def __init__(self, visual: torch.nn.Module, attention=None, compile_blocks: bool = False,
                 alignment: int = GEMM_ALIGNMENT, strided_v: bool = False, residual_in_product: bool = True,
                 window_attention=None, triton: bool | None = None):
        use_triton = compile_blocks if triton is None else triton
        self.attention = attention
        self.residual_in_product = residual_in_product
        self.before, self.after, self.project, self.up = _before_attention, _after_attention, _project, _up_projection
        if compile_blocks:
            self.before, self.after, self.project, self.up = (
                compiled_in_process(f) for f in (_before_attention, _after_attention, _project, _up_projection))
        self.rotate_qkv = triton_rotate_qkv() if use_triton else None
        self.norm_kernels = triton_norm_kernels() if use_triton else None
        mlp_kernels = triton_mlp_kernels() if use_triton else None
        if triton and None in (self.rotate_qkv, self.norm_kernels, mlp_kernels):
            raise RuntimeError("triton=True needs Triton, which cannot be imported here")
        self.strided_v = self.rotate_qkv is not None and strided_v
        if self.strided_v:
            self.rotate_qkv = functools.partial(self.rotate_qkv, contiguous_v=False)
        if self.norm_kernels is not None:
            self.project, self.up = _steps_with_norm_kernels(self.norm_kernels)
        # The MLP activations run by a Triton kernel, by the activation function a block's shape names.
        self.mlp_kernels: dict = {}
        if mlp_kernels is not None:
            # Alone on an H200 each ran 1.8 to 2.5 times as fast as Inductor's kernel
            # (benchmarks/gpu/bench_mlp_activation.py).
            self.mlp_kernels = {silu_gate: mlp_kernels.silu_gate, gelu_tanh: mlp_kernels.gelu_tanh,
                                quick_gelu: mlp_kernels.quick_gelu}
        self.replaced = 0
        self.window_attention = window_attention
        whole_image = set(getattr(visual, "fullatt_block_indexes", None) or range(len(visual.blocks)))
        for index, block in enumerate(visual.blocks):
            shape = _block_shape(block, alignment)
            if isinstance(shape, str):
                name = type(block).__name__
                if name not in _reported_shapes:
                    _reported_shapes.add(name)
                    log.info("vision block %s keeps transformers' forward: %s", name, shape)
                continue
            block.forward = self._block_forward(block, shape, windowed=index not in whole_image)
            self.replaced += 1
            if self.replaced == 1 and self.norm_kernels is not None and not _norm_kernels_agree(
                    self.norm_kernels, block.norm2.weight, shape.norm2_bias, shape.norm_eps):
                log.warning("the Triton norm kernels disagree with torch's norm on %s; the blocks run the torch "
                            "code for their norms", block.norm2.weight.device)
                self.norm_kernels = None
                self.project, self.up = (compiled_in_process(f) if compile_blocks else f
                                         for f in (_project, _up_projection))

    @staticmethod
    def remove(visual: torch.nn.Module) -> None:
        """Give every block back transformers' own forward."""
        for block in visual.blocks:
            block.__dict__.pop("forward", None)

    def use_eager(self) -> None:
        self.before, self.after, self.project, self.up = _before_attention, _after_attention, _project, _up_projection
        self.rotate_qkv, self.mlp_kernels, self.strided_v, self.norm_kernels = None, {}, False, None

    def _block_forward(self, block: torch.nn.Module, shape: _BlockShape, windowed: bool = False):
        attn = block.attn
        up_weight, up_bias, down_weight = shape.mlp
        qkv_weight, proj_weight = attn.qkv.weight, attn.proj.weight
        heads, scale, eps = attn.num_heads, attn.scaling, shape.norm_eps
        # Fixed per block: a window block of a windowed tower takes its own kernel where one was given.
        attention = self.window_attention if windowed and self.window_attention is not None else self.attention

        def forward(hidden_states, cu_seqlens, max_seqlen=None, position_embeddings=None, **_):
            if self.rotate_qkv is not None:
                qkv = self.project(hidden_states, block.norm1.weight, shape.norm1_bias, qkv_weight,
                                   attn.qkv.bias, eps)
                q, k, v = self.rotate_qkv(qkv.view(hidden_states.shape[0], 3, heads, -1),
                                          *(t.float() for t in position_embeddings))
            else:
                cos, sin = (t.float().unsqueeze(-2) for t in position_embeddings)
                q, k, v = self.before(hidden_states, block.norm1.weight, shape.norm1_bias, qkv_weight,
                                      attn.qkv.bias, cos, sin, eps, heads)
            if attention is None:
                attended = _windowed_sdpa(q, k, v, cu_seqlens, scale)
            else:
                if max_seqlen is None:
                    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
                cu = cu_seqlens.to(torch.int32)
                attended = attention(q, k, v, cu, cu, int(max_seqlen), int(max_seqlen), scale)
            activation = self.mlp_kernels.get(shape.activation)
            if activation is not None:
                # With the add in the product, the residual stream comes back with the MLP's last bias in it.
                carried = shape.down_bias if self.residual_in_product else None
                x, h = self.up(hidden_states, attended, proj_weight, attn.proj.bias, block.norm2.weight,
                               shape.norm2_bias, up_weight, up_bias, eps, carried)
                if self.residual_in_product:
                    return _add_down_projection(x, activation(h), down_weight)
                return x + linear(activation(h), down_weight, shape.down_bias)
            return self.after(hidden_states, attended, proj_weight, attn.proj.bias, block.norm2.weight,
                              shape.norm2_bias, up_weight, up_bias, down_weight, shape.down_bias, eps,
                              shape.activation)

        return forward


def block_kernels(fast: FastVisionBlocks | None) -> dict[str, str]:
    """Which steps of a tower's fast blocks (None: none) run a Triton kernel, for logs and reports: q/k/v (and
    whether v stays in the projection), the norms, the MLP's activations."""
    if fast is None:
        return {"qkv": "torch", "norm": "torch", "mlp": "torch"}
    qkv = "torch" if fast.rotate_qkv is None else "triton, v strided" if fast.strided_v else "triton"
    # The norm kernels run only in the steps that have a Triton kernel (FastVisionBlocks says why).
    beside = fast.rotate_qkv is not None or bool(fast.mlp_kernels)
    return {"qkv": qkv, "norm": "triton" if fast.norm_kernels is not None and beside else "torch",
            "mlp": "triton" if fast.mlp_kernels else "torch"}


def groups_by_patches(items: Sequence, patches_of, max_patches: int):
    """Consecutive groups of items whose patches (``patches_of(item)``) stay within max_patches; an item larger
    than the bound forms a group of its own."""
    group: list = []
    patches = 0
    for item in items:
        n = patches_of(item)
        if group and patches + n > max_patches:
            yield group
            group, patches = [], 0
        group.append(item)
        patches += n
    if group:
        yield group


@dataclass
class EncodedImage:
    # (visual tokens, image_embeds width) on the encoder's device: the main merger's output, then any DeepStack levels
    tokens: torch.Tensor
    grid_thw: tuple[int, int, int]
    # Columns of ``tokens`` that are the main merger's output (out_hidden_size).
    embedding_width: int | None = None

    def mean_pooled(self) -> np.ndarray:
        return mean_pool(self.tokens, self.embedding_width)


def mean_pool(tokens: torch.Tensor, width: int | None = None) -> np.ndarray:
    """The embedding published on the embeddings topic: the mean over the image's visual tokens of the main merger's
    output (the first ``width`` columns; DeepStack levels after them are left out), accumulated in float32, stored
    as float16."""
    return tokens[:, :width].float().mean(0).to(torch.float16).cpu().numpy()


def mean_pooled(tokens: Sequence[torch.Tensor], width: int | None = None) -> torch.Tensor:
    """``mean_pool`` of each image's tokens as one (images, width) float16 tensor, on the tokens' device."""
    return torch.stack([t[:, :width].float().mean(0) for t in tokens]).to(torch.float16)


def mean_pool_each(tokens: Sequence[torch.Tensor], width: int | None = None) -> list[np.ndarray]:
    """``mean_pool`` of each image's tokens, brought to the host in one copy. Each copy from the GPU waits for it,
    and on a GPU shared with the language model every wait can last the other context's turn: one per batch, not
    one per image."""
    if not tokens:
        return []
    return list(mean_pooled(tokens, width).cpu().numpy())


def to_host_later(tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Each tensor as a CPU tensor with storage of its own, the copies started without waiting for the GPU: they
    are readable once the returned event has passed (None: CPU tensors, copied already)."""
    if not tensors or not tensors[0].is_cuda:
        return [t.clone(memory_format=torch.contiguous_format) for t in tensors], None
    # One page-locked tensor per input, each filled by the GPU's DMA: no byte passes through this thread's core (a
    # pageable copy is the driver's memcpy through a staging buffer, and a copy of a batch split into clones is a
    # CPU memcpy of every byte: 117 MB per 12.8 MP Qwen2.5-VL image, 32 MB per 1 MP Qwen3-VL one with its
    # DeepStack levels). torch's caching host allocator reuses the pinned blocks.
    hosts = []
    for t in tensors:
        host = _page_locked(lambda t=t: torch.empty(t.shape, dtype=t.dtype, pin_memory=True))
        hosts.append(torch.empty(t.shape, dtype=t.dtype) if host is None else host)
    for host, t in zip(hosts, tensors):
        host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensors[0].device))
    return hosts, event


def to_host_each(tokens: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each image's tokens as a CPU tensor with storage of its own (``to_host_later``), after one wait. Own storage
    because vLLM's front end serialises each tensor with its whole storage: a view into the batch would ship the
    batch once per image."""
    hosts, copied = to_host_later(tokens)
    if copied is not None:
        copied.synchronize()
    return hosts


class GridIndexParts:
    """Each image grid's part of a forward's index tensors (``VisionEncoder._image_index_parts``), derived once and
    kept, least recently used first out beyond ``max_bytes``. Images resized to one pixel budget fall into few grids
    (one per aspect ratio the budget's rounding keeps), so most batches find every part here."""

    def __init__(self, derive, max_bytes: int = 256 << 20):
        self._derive, self.max_bytes = derive, max_bytes
        self._kept: collections.OrderedDict[tuple, dict[str, torch.Tensor]] = collections.OrderedDict()
        self._bytes = 0

    def get(self, grid: tuple) -> dict[str, torch.Tensor]:
        parts = self._kept.get(grid)
        if parts is not None:
            self._kept.move_to_end(grid)
            return parts
        parts = self._derive(grid)
        self._kept[grid] = parts
        self._bytes += _nbytes(parts)
        while self._bytes > self.max_bytes and len(self._kept) > 1:
            _, dropped = self._kept.popitem(last=False)
            self._bytes -= _nbytes(dropped)
        return parts

    def __len__(self) -> int:
        return len(self._kept)


def _nbytes(parts: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in parts.values())


class TowerPass:
    """One forward's outputs on their way to the host: launched by ``VisionEncoder.launch``, read by ``wait``.

    The launch queues the tower's kernels and the copies to the host and returns without waiting for the GPU, so
    the thread that feeds vLLM can prepare the next forward (patchify, index tensors, launches) while the GPU runs
    this one. On a GPU shared with vLLM's engine every wait can last the other context's turn; a thread that waited
    for each forward before preparing the next left the tower's queue empty for that host work.
    Only host tensors and an event are kept: the GPU tensors return to the caching allocator at once, which is safe
    because every later use of that memory is queued on the same stream after these copies."""

    def __init__(self, tokens: list[torch.Tensor | None], pooled: torch.Tensor | None, wanted: list[int],
                 copied: torch.cuda.Event | None):
        self._tokens, self._pooled, self._wanted, self._copied = tokens, pooled, wanted, copied

    def wait(self) -> tuple[list[torch.Tensor | None], list[np.ndarray | None]]:
        """(each image's ``image_embeds`` on the host or None where not asked for, each image's embedding as
        ``mean_pool`` makes it or None where not asked for)."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None
        embeddings: list[np.ndarray | None] = [None] * len(self._tokens)
        for row, i in zip(self._pooled.numpy() if self._pooled is not None else (), self._wanted):
            embeddings[i] = row
        return self._tokens, embeddings


class VisionEncoder:
    """A Qwen family's vision tower (``model.visual`` or a tower loaded alone) behind ``encode(images)``.

    Images of any sizes (multiples of the family's factor) share one forward: their patches are concatenated, their
    grids stacked, and the varlen attention keeps them apart. ``max_patches_per_call`` bounds the activation
    memory of one forward. Each image's output is its ``image_embeds``: the merged tokens, then for a tower with
    DeepStack levels (Qwen3-VL) each level's merged tokens, concatenated on the feature axis.
    ``family`` defaults to the one whose patch size and merge size the tower's config has. On CUDA the fast blocks
    are compiled, with the Triton kernels (``FastVisionBlocks``); a compile that fails leaves them eager, with a
    warning. A windowed tower's window blocks get their own kernel (``pick_window_attention``).
    ``residual_in_product`` and ``strided_v``: as ``FastVisionBlocks`` takes them; ``strided_v`` None (the default)
    where the attention takes it (``takes_strided_v``).
    """

    def __init__(self, visual: torch.nn.Module, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, attention: str = "auto",
                 max_patches_per_call: int = 65536, linear_patch_embedding: bool = True,
                 fast_blocks: bool = True, family: ModelFamily | None = None, strided_v: bool | None = None,
                 residual_in_product: bool = True):
        self.family = family or family_of_tower(visual)
        # Qwen2.5-VL's windowed tower: window indices precomputed.
        self.windowed = hasattr(visual, "window_size") and hasattr(visual, "fullatt_block_indexes")
        self._grid_parts = GridIndexParts(self._image_index_parts)
        self.deepstack_levels = len(getattr(visual, "deepstack_visual_indexes", None) or ())
        self.embedding_width = ModelFamily.embedding_width(visual.config.to_dict())
        self.image_embeds_width = self.embedding_width * (1 + self.deepstack_levels)
        self.device = torch.device(device)
        self.dtype = dtype or next(visual.parameters()).dtype
        self.visual = visual.to(self.device, self.dtype).eval()
        if linear_patch_embedding:  # False only to measure what the swap is worth
            use_linear_patch_embedding(self.visual)
        self.attention = pick_vision_attention(self.device, self.dtype, attention)
        self.window_attention = (pick_window_attention(self.device, self.dtype, self.attention)
                                 if self.windowed and fast_blocks else None)
        # The tower's config object is its own (vision_config); the language model keeps its implementation.
        self.visual.config._attn_implementation = self.attention
        self.merge_unit = self.visual.config.spatial_merge_size ** 2
        self.max_patches_per_call = max_patches_per_call
        self.compiled = False
        self.fast = None
        FastVisionBlocks.remove(self.visual)
        if fast_blocks:  # False only to measure what they are worth
            compile_blocks = self.device.type == "cuda"
            kernels = [self.attention] + ([self.window_attention] if self.window_attention else [])
            if strided_v is None:
                strided_v = all(name not in VARLEN_KERNELS or takes_strided_v(name, self.device, self.dtype)
                                for name in kernels)
            fast = FastVisionBlocks(self.visual, VARLEN_KERNELS.get(self.attention), compile_blocks,
                                    strided_v=strided_v, residual_in_product=residual_in_product,
                                    window_attention=VARLEN_KERNELS.get(self.window_attention))
            self.fast = fast if fast.replaced else None
            if compile_blocks and self.fast is not None:
                self.compiled = self._warm_up_compiled()

    def _warm_up_compiled(self) -> bool:
        """Compile now (tens of seconds, once) rather than inside the first real batch; on any compiler
        failure run the same blocks eagerly. The first forward is of a working size (4,096 patches, a 1 MP image or
        a batch of small ones): Inductor tunes each generated kernel's launch configuration on its first launch and
        keeps it for every size after, so a first forward of a few dozen patches would leave the kernels tuned for
        that. The second, of another size, checks that the compiled code takes any size."""
        factor = self.family.factor
        working = np.zeros((factor * 32, factor * 32, 3), np.uint8)
        small = np.zeros((factor * 4, factor * 6, 3), np.uint8)
        started = time.perf_counter()
        try:
            for batch in ([working], [small, small[: factor * 2]]):
                self.encode(batch)
            log.info("vision blocks compiled in %.1fs", time.perf_counter() - started)
            return True
        except Exception as exc:  # noqa: BLE001 - an optimisation must never stop the engine
            log.warning("torch.compile of the vision blocks failed (%s: %s); running them eagerly",
                        type(exc).__name__, str(exc)[:500])
            self.fast.use_eager()
            return False

    @torch.inference_mode()
    def encode_patches(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> list[torch.Tensor]:
        """Already patchified input (as the processor or ``patchify_batch`` returns it) -> per-image ``image_embeds``
        (merged tokens, then any DeepStack levels' merged tokens, on the feature axis)."""
        grid_cpu = grid_thw.cpu()  # free when it is there already, as patchify_batch leaves it
        out = self.visual(pixel_values.to(self.device, self.dtype), grid_thw=to_device(grid_cpu, self.device),
                          **self._index_inputs(grid_cpu))
        merged = out.pooler_output if hasattr(out, "pooler_output") else out
        deepstack = list(getattr(out, "deepstack_features", None) or ())
        if len(deepstack) != self.deepstack_levels:
            raise RuntimeError(f"the vision tower returned {len(deepstack)} DeepStack levels, its config names "
                               f"{self.deepstack_levels}")
        if deepstack:
            merged = torch.cat([merged, *deepstack], dim=-1)
        sizes = (grid_cpu.prod(-1) // self.merge_unit).tolist()
        return list(merged.split(sizes))

    def _index_inputs(self, grid_cpu: torch.Tensor) -> dict:
        """The forward's index tensors (rotary positions, window order, sequence bounds; for a tower with a learned
        position grid, the taps and weights that resample it to each image), derived from the grid on the CPU and
        sent over with the batch. From a grid on the GPU, transformers derives them there in many small kernels and
        waits for the GPU several times per forward (.tolist(), .item(), unique_consecutive): each wait a stall
        behind the language model's turn when both share the GPU. Each image's part is derived once per grid and
        kept (``GridIndexParts``): derived afresh it cost several ms of host time per batch, in vLLM's engine process
        time the GPU waits. Empty (transformers derives them itself) where its vision_utils cannot take them
        (before transformers 5)."""
        if _vision_utils is None:
            return {}
        grids = [tuple(g) for g in grid_cpu.tolist()]
        parts = [self._grid_parts.get(g) for g in grids]
        cu_seqlens = _vision_utils.get_vision_cu_seqlens(grid_cpu)
        inputs = {"position_ids": torch.cat([p["position_ids"] for p in parts]), "cu_seqlens": cu_seqlens}
        if "interp_indices" in parts[0]:
            inputs["interp_indices"] = torch.cat([p["interp_indices"] for p in parts])
            inputs["interp_weights"] = torch.cat([p["interp_weights"] for p in parts])
        if "window_index" in parts[0]:
            # Each image's window order counts its merged tokens and its window bounds its patches from 0: shifted
            # by the images before it, as get_vision_window_index numbers them over the batch.
            patches = [t * h * w for t, h, w in grids]
            before = [sum(patches[:i]) for i in range(len(patches))]
            unit = self.visual.spatial_merge_size ** 2
            inputs["window_index"] = torch.cat([p["window_index"] + b // unit for p, b in zip(parts, before)])
            bounds = torch.cat([torch.zeros(1, dtype=torch.long)] + [p["window_bounds"] + b
                                                                     for p, b in zip(parts, before)])
            cu_window_seqlens = torch.unique_consecutive(bounds).to(torch.int32)
            inputs["cu_window_seqlens"] = cu_window_seqlens
            inputs["max_window_seqlen"] = _longest(cu_window_seqlens)
        inputs = {key: self._there(value) if isinstance(value, torch.Tensor) else value
                  for key, value in inputs.items()}
        inputs["max_seqlen"] = _longest(cu_seqlens)
        return inputs

    def _image_index_parts(self, grid: tuple[int, int, int]) -> dict[str, torch.Tensor]:
        """One image's part of ``_index_inputs``: transformers' vision_utils on a batch of that image alone."""
        visual = self.visual
        one = torch.tensor([grid], dtype=torch.long)
        parts = {"position_ids": _vision_utils.get_vision_position_ids(one, visual.spatial_merge_size)}
        if hasattr(visual, "num_grid_per_side"):  # Qwen3-VL / Qwen3.5: a learned position grid, resampled
            parts["interp_indices"], parts["interp_weights"] = \
                _vision_utils.get_vision_interpolation_indices_and_weights(
                    one, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
                    align_corners=visual.interpolation_align_corners,
                    spatial_merge_size=visual.config.spatial_merge_size)
        if self.windowed:  # Qwen2.5-VL
            window_index, bounds = _vision_utils.get_vision_window_index(
                one, spatial_merge_size=visual.spatial_merge_size, window_size=visual.window_size,
                patch_size=visual.patch_size)
            parts["window_index"], parts["window_bounds"] = window_index, bounds[1:].to(torch.long)
        return parts

    def _there(self, tensor: torch.Tensor) -> torch.Tensor:
        return to_device(tensor, self.device)

    def encode_images(self, images: Sequence[np.ndarray | torch.Tensor]) -> list[torch.Tensor]:
        """Exact-size H x W x 3 uint8 images (one forward: the caller keeps them within ``max_patches_per_call``;
        on the host or the device) -> per-image ``image_embeds``."""
        pixel_values, grid_thw = patchify_batch(images, self.device, self.dtype, self.family)
        return self.encode_patches(pixel_values, grid_thw)

    def encode(self, images: Sequence[np.ndarray]) -> list[EncodedImage]:
        results: list[EncodedImage] = []
        for group in self._groups(images):
            tokens = self.encode_images(group)
            results += [EncodedImage(t, grid_for(im.shape[0], im.shape[1], self.family), self.embedding_width)
                        for t, im in zip(tokens, group)]
        return results

    @torch.inference_mode()
    def launch(self, images: Sequence[np.ndarray], with_tokens: bool, wanted: Sequence[int]) -> TowerPass:
        """One forward over ``images`` (one group: the caller keeps it within ``max_patches_per_call``), queued on
        the current stream with its copies to the host (``TowerPass``). ``with_tokens``: bring each image's
        ``image_embeds`` back; ``wanted``: the indices of the images whose embedding is published."""
        pixel_values, grid_thw = patchify_batch(images, self.device, self.dtype, self.family)
        tokens = self.encode_patches(pixel_values, grid_thw)
        wanted = list(wanted)
        outgoing = (list(tokens) if with_tokens else []) + ([mean_pooled([tokens[i] for i in wanted],
                                                                         self.embedding_width)] if wanted else [])
        hosts, copied = to_host_later(outgoing)
        return TowerPass(hosts[:len(tokens)] if with_tokens else [None] * len(tokens),
                         hosts[-1] if wanted else None, wanted, copied)

    def _groups(self, images: Sequence[np.ndarray]):
        return groups_by_patches(images, lambda im: self.family.patches(im.shape[0], im.shape[1]),
                                 self.max_patches_per_call)


def _longest(bounds: torch.Tensor) -> int:
    """The longest sequence that cumulative bounds describe (0 for none)."""
    return int((bounds[1:] - bounds[:-1]).max()) if len(bounds) > 1 else 0


def family_of_tower(visual: torch.nn.Module) -> ModelFamily:
    """The family whose patch and merge sizes a tower's config has (for an encoder built without one)."""
    from vlmstream.models.registry import families

    for family in families().values():
        if any(tower.model_class.endswith(f":{type(visual).__name__}") for tower in family.towers.values()):
            return family
    config = visual.config
    patch, merge = int(config.patch_size), int(config.spatial_merge_size)
    for family in families().values():
        if (family.patch_size, family.merge_size) == (patch, merge) and family.towers:
            return family
    raise ValueError(f"no model family has {patch} px patches merged {merge} x {merge}")


# ---------------------------------------------------------------------------------------------------------
# Loading the tower alone (for the vLLM embeds mode, where vLLM holds the language model).
# ---------------------------------------------------------------------------------------------------------

VISION_PREFIXES = ("visual.", "model.visual.")


def _import(spec: str):
    import importlib

    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name)


def checkpoint_tower(model_path: str | Path):
    """(family, tower spec, raw vision_config) of a checkpoint folder, from its config.json."""
    from vlmstream.models.registry import family_of

    family = family_of(model_path)
    config = json.loads((Path(model_path) / "config.json").read_text())
    return family, family.tower_for(config.get("model_type")), config["vision_config"]


def vision_config_from(model_path: str | Path):
    _, tower, raw = checkpoint_tower(model_path)
    return _import(tower.config_class)(**{k: v for k, v in raw.items() if k != "model_type"})


def vision_state_dict(model_path: str | Path) -> dict[str, torch.Tensor]:
    """The tower's weights from a checkpoint's safetensors (keys ``visual.*`` in the released layout,
    ``model.visual.*`` in transformers 5's), prefix removed; empty when the folder has no weights."""
    from safetensors import safe_open

    state: dict[str, torch.Tensor] = {}
    for shard in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for key in f.keys():
                for prefix in VISION_PREFIXES:
                    if key.startswith(prefix):
                        state[key[len(prefix):]] = f.get_tensor(key)
    return state


def load_vision_tower(model_path: str | Path, device: torch.device | str = "cpu",
                      dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> tuple[torch.nn.Module, bool]:
    """(tower, has_real_weights). A folder without weights (vLLM ``load_format="dummy"``) gets a seeded
    random tower: same compute, so throughput figures hold; embeddings are then meaningless. The tower's class
    is the family's for the checkpoint's model_type (vlmstream/models/)."""
    _, spec, _ = checkpoint_tower(model_path)
    tower_class = _import(spec.model_class)
    config = vision_config_from(model_path)
    config._attn_implementation = "sdpa"
    state = vision_state_dict(model_path)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            tower = tower_class._from_config(config, dtype=dtype).eval()
    if state:
        missing, unexpected = tower.load_state_dict(state, strict=False)
        # The rotary inverse frequencies are computed, not stored; anything else missing is a wrong checkpoint.
        missing = [k for k in missing if "inv_freq" not in k]
        if missing or unexpected:
            raise RuntimeError(f"vision weights in {model_path} do not fit the tower: missing {missing[:5]}, "
                               f"unexpected {unexpected[:5]}")
    return tower, bool(state)


def request_problem(image: object, grid_thw: tuple[int, int, int], family: ModelFamily = QWEN2_VL) -> str | None:
    """Why an inference request's image cannot be encoded, or None. Checked before batching so one bad
    request fails alone instead of failing its batch."""
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        shape = getattr(image, "shape", None)
        return f"image must be an H x W x 3 uint8 RGB array, got {type(image).__name__} {shape}"
    height, width = image.shape[:2]
    problem = family.size_problem(height, width)
    if problem:
        return problem
    if tuple(grid_thw) != family.grid_thw(height, width):
        return f"grid_thw {tuple(grid_thw)} does not match the {width}x{height} image"
    return None

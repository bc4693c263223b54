"""Attention for the vision blocks. transformers sends a packed varlen call (cu_seqlens over windows and images) to any
registered implementation whose name contains "flash"; its sdpa path instead loops in Python over every window of
every image. On CUDA vLLM's FlashAttention 3 (what vLLM's own tower runs; ``vllm_adapter.flash_attention_3_varlen``,
on the vLLM release the adapter was checked against) or torch's built-in varlen flash attention
is registered under such a name, each probed once against sdpa before it is picked; the fast blocks call the raw
kernels (``VARLEN_KERNELS``) directly, and ``windowed_sdpa`` where there is none (CPU)."""

from __future__ import annotations

import logging

import torch

from vlmstream import vllm_adapter

log = logging.getLogger(__name__)

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
    candidates = {"vllm_fa3": (VLLM_FA3, vllm_adapter.flash_attention_3_varlen),
                  "torch_varlen": (TORCH_VARLEN, _torch_varlen_kernel)}
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


def windowed_sdpa(q, k, v, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention within each [cu[i], cu[i+1]) window, for devices without a varlen kernel (CPU)."""
    bounds = cu_seqlens.tolist()
    out = torch.empty_like(q)
    for start, end in zip(bounds[:-1], bounds[1:]):
        # 4-D (1, heads, tokens, dim): with 3-D input torch takes its slow math path on CPU.
        window = [t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v)]
        out[start:end] = torch.nn.functional.scaled_dot_product_attention(*window, scale=scale)[0].transpose(0, 1)
    return out

"""``VisionEncoder``: a Qwen family's vision tower behind ``encode(images)``. It batches images of any sizes into one
varlen forward (within ``max_patches_per_call``), sends the forward's index tensors derived on the CPU
(``GridIndexParts``), swaps the patch embedding's Conv3d for its matrix product (``PatchProjection``) and puts the
fast blocks (``blocks.py``) in the tower's blocks, compiled on CUDA."""

from __future__ import annotations

import collections
import logging
import time
from typing import Sequence

import numpy as np
import torch

from consumers.infer.vision.attention import (VARLEN_KERNELS, pick_vision_attention, pick_window_attention,
                                              takes_strided_v)
from consumers.infer.vision.blocks import FastVisionBlocks
from consumers.infer.vision.checkpoint import family_of_tower
from consumers.infer.vision.outputs import EncodedImage, TowerPass, mean_pooled, to_host_later
from consumers.infer.vision.pixels import grid_for, patchify_batch, to_device
from vlmstream.models.family import ModelFamily

try:  # transformers 5: the vision forward takes its index tensors precomputed (VisionEncoder._index_inputs)
    from transformers import vision_utils as _vision_utils
except ImportError:  # older transformers derives them itself
    _vision_utils = None

log = logging.getLogger(__name__)


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


class VisionEncoder:
    """A Qwen family's vision tower (``model.visual`` or a tower loaded alone) behind ``encode(images)``.

    Images of any sizes (multiples of the family's factor) share one forward: their patches are concatenated, their
    grids stacked, and the varlen attention keeps them apart. ``max_patches_per_call`` bounds the activation
    memory of one forward. Each image's output is its ``image_embeds``: the merged tokens, then for a tower with
    DeepStack levels (Qwen3-VL) each level's merged tokens, concatenated on the feature axis.
    ``family`` defaults to the one whose patch size and merge size the tower's config has. On CUDA the fast blocks
    are compiled, with the Triton kernels (``FastVisionBlocks``); a compile that fails leaves them eager, with a
    warning. A windowed tower's window blocks get their own kernel (``pick_window_attention``). The q/k/v kernel
    leaves v as a view of the projection where every attention the blocks run takes it so (``takes_strided_v``).
    """

    def __init__(self, visual: torch.nn.Module, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, attention: str = "auto",
                 max_patches_per_call: int = 65536, family: ModelFamily | None = None):
        self.family = family or family_of_tower(visual)
        # Qwen2.5-VL's windowed tower: window indices precomputed.
        self.windowed = hasattr(visual, "window_size") and hasattr(visual, "fullatt_block_indexes")
        self._grid_parts = GridIndexParts(self._image_index_parts)
        self.deepstack_levels = len(getattr(visual, "deepstack_visual_indexes", None) or ())
        self.embedding_width = ModelFamily.embedding_width(visual.config.to_dict())
        self.image_embeds_width = self.embedding_width * (1 + self.deepstack_levels)
        self.device = torch.device(device)
        self.dtype = dtype or next(visual.parameters()).dtype
        self.visual = use_linear_patch_embedding(visual.to(self.device, self.dtype).eval())
        self.attention = pick_vision_attention(self.device, self.dtype, attention)
        # The tower's config object is its own (vision_config); the language model keeps its implementation.
        self.visual.config._attn_implementation = self.attention
        self.merge_unit = self.visual.config.spatial_merge_size ** 2
        self.max_patches_per_call = max_patches_per_call
        self.window_attention: str | None = None
        self.compiled = False
        self.fast: FastVisionBlocks | None = None
        FastVisionBlocks.remove(self.visual)
        self._install_fast_blocks()

    def _install_fast_blocks(self) -> None:
        """``FastVisionBlocks`` in the tower's blocks (a windowed tower's window blocks with their own kernel),
        compiled and warmed up on CUDA."""
        if self.windowed:
            self.window_attention = pick_window_attention(self.device, self.dtype, self.attention)
        compile_blocks = self.device.type == "cuda"
        kernels = [self.attention] + ([self.window_attention] if self.window_attention else [])
        strided_v = all(name not in VARLEN_KERNELS or takes_strided_v(name, self.device, self.dtype)
                        for name in kernels)
        fast = FastVisionBlocks(self.visual, VARLEN_KERNELS.get(self.attention), compile_blocks, strided_v=strided_v,
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

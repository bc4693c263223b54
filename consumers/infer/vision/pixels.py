"""The image's way onto the tower's device: its uint8 pixels copied there without waiting for the GPU (``to_device``),
then rescaled, normalised and cut into patches there (``patchify``), in exactly the layout transformers'
Qwen2VLImageProcessor produces with ``do_resize=False`` (every Qwen family uses it, with its own patch size and
normalisation). vLLM's front end does this on one CPU core (209 ms for a 12.8 MP image); here the uint8 pixels
travel as they are, a quarter of the float bytes."""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch

from vlmstream.models.family import ModelFamily
from vlmstream.models.qwen2_vl import QWEN2_VL

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


def page_locked(make):
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
    staged = tensor if tensor.is_pinned() else page_locked(tensor.pin_memory)
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

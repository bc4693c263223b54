"""``ModelFamily``: one vision-language model family's image input, as the decode stage, the vision tower and the
engines need it. The numbers live in the family's own module (``vlmstream/models/qwen2_vl.py``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

# (height, width, factor, min_pixels, max_pixels) -> (height, width): a family's resize rule.
SizeRule = Callable[[int, int, int, int, int], "tuple[int, int]"]


@dataclass(frozen=True)
class ModelFamily:
    """A model family's image input. Images reach the model at ``target_size``: both sides multiples of
    ``factor`` (patch size x merge size), cut into ``patch_size`` patches, ``merge_size`` x ``merge_size`` patches
    merged into one visual token for the language model."""

    name: str
    # Matched against a checkpoint's config.json by the registry.
    model_types: tuple[str, ...]
    architectures: tuple[str, ...]
    patch_size: int
    merge_size: int
    # Frames per patch: a still image is repeated over this axis.
    temporal_patch_size: int
    image_mean: tuple[float, float, float]
    image_std: tuple[float, float, float]
    # The released checkpoints' budget (their preprocessor_config.json), which the pipeline defaults to.
    min_pixels: int
    max_pixels: int
    # The image processor class's own budget, for a checkpoint whose preprocessor config names none.
    processor_max_pixels: int
    size_rule: SizeRule = field(repr=False, compare=False)

    @property
    def factor(self) -> int:
        """Both sides of a model input are multiples of this many pixels."""
        return self.patch_size * self.merge_size

    @property
    def merge_unit(self) -> int:
        """Patches per visual token."""
        return self.merge_size * self.merge_size

    @property
    def max_visual_tokens(self) -> int:
        """Visual tokens of an image at ``max_pixels``."""
        return self.max_pixels // (self.factor * self.factor)

    def with_pixel_limits(self, min_pixels: int, max_pixels: int) -> ModelFamily:
        return replace(self, min_pixels=min_pixels, max_pixels=max_pixels)

    def target_size(self, height: int, width: int, min_pixels: int | None = None,
                    max_pixels: int | None = None) -> tuple[int, int]:
        """(height, width) the model takes an image of ``height`` x ``width`` at; the limits default to the
        family's."""
        return self.size_rule(height, width, self.factor,
                              self.min_pixels if min_pixels is None else min_pixels,
                              self.max_pixels if max_pixels is None else max_pixels)

    def size_problem(self, height: int, width: int) -> str | None:
        """Why ``height`` x ``width`` is not a model input size, or None."""
        factor = self.factor
        if height < factor or width < factor or height % factor or width % factor:
            return f"image {width}x{height} is not a positive multiple of {factor} px (smart_resize it first)"
        return None

    def grid_thw(self, height: int, width: int) -> tuple[int, int, int]:
        """(frames, patch rows, patch columns) of an image already at a model input size."""
        return 1, height // self.patch_size, width // self.patch_size

    def patches(self, height: int, width: int) -> int:
        return (height // self.patch_size) * (width // self.patch_size)

    def visual_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """Language-model tokens of an image with this grid."""
        frames, rows, columns = grid_thw
        return frames * rows * columns // self.merge_unit

"""``ModelFamily``: one vision-language model family, as the decode stage, the vision tower, the engines and the
tiny-model writer need it. The numbers live in the family's own module (``vlmstream/models/qwen2_vl.py``,
``qwen3_vl.py``, ``qwen3_5.py``); ``generic.py`` is the path for every other vision model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

# (height, width, factor, min_pixels, max_pixels) -> (height, width): a family's resize rule.
SizeRule = Callable[[int, int, int, int, int], "tuple[int, int]"]


@dataclass(frozen=True)
class Tower:
    """How to build a family's vision tower alone from a checkpoint's ``vision_config``: transformers classes as
    ``module:Name`` (imported by the engines, never here), and whether its forward attends within windows."""

    model_class: str
    config_class: str
    # Qwen2.5-VL's windowed tower: the forward takes window indices. vision.blocks.FastVisionBlocks fits its blocks
    # (RMSNorm, gated MLP) and those of every other Qwen tower (LayerNorm, two-matrix MLP) alike.
    windowed: bool = False


# Qwen chat markup, shared by every Qwen family: one user turn, the image first, then the instruction.
QWEN_IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_IMAGE_PAD = "<|image_pad|>"


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
    # The vision tower by the checkpoint's model_type (a family may hold several, e.g. Qwen2-VL and Qwen2.5-VL).
    towers: dict[str, Tower] = field(default_factory=dict, repr=False, compare=False)
    # The prompt when the tokenizer has no chat template: ``{image}`` is the placeholder, ``{prompt}`` the instruction.
    prompt_template: str = ("<|im_start|>user\n{image}{prompt}<|im_end|>\n<|im_start|>assistant\n")
    image_placeholder: str = QWEN_IMAGE_PLACEHOLDER
    image_pad: str = QWEN_IMAGE_PAD
    # False for the generic path (generic.py): images reach the engine at any size the model's processor then
    # resizes, and grid_thw is an estimate for flow control, not the model's patch grid.
    exact_size: bool = True

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

    def tower_for(self, model_type: str | None) -> Tower:
        """The vision tower of a checkpoint of ``model_type`` (the family's first one when it names none)."""
        if not self.towers:
            raise ValueError(f"model family {self.name} runs no vision tower of its own (the model's processor and "
                             "tower do it): use infer.mode=pixels")
        return self.towers.get(model_type or "", next(iter(self.towers.values())))

    @staticmethod
    def image_embeds_width(vision_config: dict) -> int:
        """Width of the ``image_embeds`` the language model takes: the merger's ``out_hidden_size``, times one plus
        the number of DeepStack levels (Qwen3-VL: the features of ``deepstack_visual_indexes`` layers, concatenated
        after the main merger's output, as vLLM's Qwen3-VL takes them)."""
        levels = len(vision_config.get("deepstack_visual_indexes") or ())
        return ModelFamily.embedding_width(vision_config) * (1 + levels)

    @staticmethod
    def embedding_width(vision_config: dict) -> int:
        """Width of the vector on the embeddings topic: the mean over an image's visual tokens of the main
        merger's output (the tokens the language model reads in place of the image pads; DeepStack features
        left out), so ``out_hidden_size``, the language model's hidden size (Qwen2-VL's vision config calls it
        ``hidden_size``; its tower's own width is ``embed_dim``)."""
        return int(vision_config.get("out_hidden_size") or vision_config["hidden_size"])

    def prompt(self, instruction: str) -> str:
        """The family's single-image prompt around ``instruction`` (used when the tokenizer has no chat template)."""
        return self.prompt_template.format(image=self.image_placeholder, prompt=instruction)

    def target_size(self, height: int, width: int, min_pixels: int | None = None,
                    max_pixels: int | None = None) -> tuple[int, int]:
        """(height, width) the model takes an image of ``height`` x ``width`` at; the limits default to the
        family's."""
        return self.size_rule(height, width, self.factor,
                              self.min_pixels if min_pixels is None else min_pixels,
                              self.max_pixels if max_pixels is None else max_pixels)

    def size_problem(self, height: int, width: int) -> str | None:
        """Why ``height`` x ``width`` is not a model input size, or None."""
        if not self.exact_size:
            return None if height >= 1 and width >= 1 else f"image {width}x{height} has no pixels"
        factor = self.factor
        if height < factor or width < factor or height % factor or width % factor:
            return f"image {width}x{height} is not a positive multiple of {factor} px (smart_resize it first)"
        return None

    def grid_thw(self, height: int, width: int) -> tuple[int, int, int]:
        """(frames, patch rows, patch columns) of an image already at a model input size (for the generic path, the
        estimate in its patches, a partial patch counted whole)."""
        if not self.exact_size:
            return 1, -(-height // self.patch_size), -(-width // self.patch_size)
        return 1, height // self.patch_size, width // self.patch_size

    def patches(self, height: int, width: int) -> int:
        return (height // self.patch_size) * (width // self.patch_size)

    def visual_tokens(self, grid_thw: tuple[int, int, int]) -> int:
        """Language-model tokens of an image with this grid."""
        frames, rows, columns = grid_thw
        return frames * rows * columns // self.merge_unit

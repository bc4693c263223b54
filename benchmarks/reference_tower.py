"""The vision tower with transformers' own blocks behind ``VisionEncoder``'s interface: the reference the fast blocks
are checked against (tests/test_engines.py, tests/test_families.py, benchmarks/gpu/check_tower.py) and the baseline
they are timed against (benchmarks/gpu/bench_vision_tower.py). Scripts run from the repository root (or put it on
sys.path)."""

from __future__ import annotations

from consumers.infer.vision.encoder import VisionEncoder


class TransformersBlocksEncoder(VisionEncoder):
    """``VisionEncoder`` (the patch embedding as a matrix product, the batched index tensors, the DeepStack levels)
    with the tower's blocks running transformers' forward: no fast blocks, nothing compiled, no window kernel."""

    def _install_fast_blocks(self) -> None:
        pass  # VisionEncoder gave every block back transformers' forward before this

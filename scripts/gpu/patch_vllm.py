"""The kit's edits to the vLLM it unpacks into /tmp/site, each for a part the kit leaves out or a library the GPU
machine's image holds at another version. Each edit applies once (a second run finds it in place), does nothing where
the release no longer has the code it edits, and stops the unpack where the code differs from what it was written
against.

Usage: python3 scripts/gpu/patch_vllm.py   (unpack_device.sh runs it)
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

SITE = Path("/tmp/site/vllm")


@dataclass(frozen=True)
class Edit:
    why: str
    path: str  # under vllm/
    old: str
    new: str
    gone: str  # where the file holds neither old nor new, this must be absent too (the code moved on), else stop


EDITS = [
    Edit(
        why="vLLM 0.34.0's kernel warm-up imports MiniMax-M3's MSA warm-up on every CUDA engine, and that module "
            "imports the CuTe DSL (`cutlass`, nvidia-cutlass-dsl), which the kit does not carry: every engine then "
            "died at start. The warm-up does nothing for other models; without the DSL it is skipped.",
        path="model_executor/warmup/kernel_warmup.py",
        old='''        from vllm.model_executor.warmup.minimax_m3_msa_warmup import (
            minimax_m3_msa_warmup,
        )

        minimax_m3_msa_warmup(worker)
''',
        new='''        import importlib.util

        if importlib.util.find_spec("cutlass") is not None:
            from vllm.model_executor.warmup.minimax_m3_msa_warmup import (
                minimax_m3_msa_warmup,
            )

            minimax_m3_msa_warmup(worker)
''',
        gone="minimax_m3_msa_warmup"),
    Edit(
        why="vLLM 0.26.0's pixtral.py imports PixtralRotaryEmbedding and position_ids_in_meshgrid, which transformers "
            "5.17 no longer has; llava.py imports pixtral.py, so every LLaVA-family model failed vLLM's architecture "
            "inspection. Only the Pixtral-HF tower uses the two names: they become stand-ins that raise if that "
            "tower is built, so no model computes with the wrong positions. (0.34 imports neither.)",
        path="model_executor/models/pixtral.py",
        old="from transformers.models.pixtral.modeling_pixtral import (\n    PixtralRotaryEmbedding,\n"
            "    apply_rotary_pos_emb,\n    position_ids_in_meshgrid,\n)\n",
        new='''try:
    from transformers.models.pixtral.modeling_pixtral import (
        PixtralRotaryEmbedding,
        apply_rotary_pos_emb,
        position_ids_in_meshgrid,
    )
except ImportError:  # transformers 5.17: only the Pixtral-HF tower needs these
    from transformers.models.pixtral.modeling_pixtral import apply_rotary_pos_emb

    def _missing(*args, **kwargs):
        raise NotImplementedError("vLLM 0.26's Pixtral-HF tower needs a transformers with PixtralRotaryEmbedding")

    PixtralRotaryEmbedding = position_ids_in_meshgrid = _missing
''',
        gone="PixtralRotaryEmbedding,"),
]


def apply(edit: Edit) -> str:
    path = SITE / edit.path
    text = path.read_text()
    if edit.new in text:
        return f"patched {path}"
    if edit.old in text:
        path.write_text(text.replace(edit.old, edit.new, 1))
        return f"patched {path}"
    assert edit.gone not in text, f"{path} differs from the code this edit was written against: {edit.why}"
    return f"nothing to patch in {path}"


def flashinfer_optional() -> str:
    """vLLM's sampler asks flashinfer_sampler_supported(), which imports FlashInfer unconditionally; the kit does not
    carry FlashInfer, and the engine core then died. Without it installed the function says False."""
    path = SITE / "v1/sample/ops/topk_topp_sampler.py"
    text = path.read_text()
    if 'find_spec("flashinfer")' not in text:
        edited = re.sub(r'(def flashinfer_sampler_supported\([^)]*\)[^:]*:\n)',
                        r'\1    import importlib.util\n    if importlib.util.find_spec("flashinfer") is None:\n'
                        r'        return False\n', text, count=1)
        assert edited != text, f"{path}: flashinfer_sampler_supported() not found"
        path.write_text(edited)
    return f"patched {path}"


if __name__ == "__main__":
    print(flashinfer_optional())
    for edit in EDITS:
        print(apply(edit))

# vLLM 0.26.0's pixtral.py imports PixtralRotaryEmbedding and position_ids_in_meshgrid from transformers, which
# transformers 5.17 (the device's) no longer has (its rotary class is PixtralVisionRotaryEmbedding and takes (row,
# column) position pairs). llava.py imports pixtral.py, so every LLaVA-family model (LLaVA, LLaVA-NeXT,
# LLaVA-OneVision, Mistral 3) failed vLLM's architecture inspection. Only vLLM's Pixtral-HF tower uses the two
# names: they become stand-ins that raise if that tower is built, so no model computes with the wrong positions.
p = '/tmp/site/vllm/model_executor/models/pixtral.py'
s = open(p).read()
old = ("from transformers.models.pixtral.modeling_pixtral import (\n    PixtralRotaryEmbedding,\n"
       "    apply_rotary_pos_emb,\n    position_ids_in_meshgrid,\n)\n")
new = '''try:
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
'''
if "_missing" in s:
    print("patched", p)
elif old in s:
    open(p, 'w').write(s.replace(old, new, 1))
    print("patched", p)
else:
    # vLLM 0.34's pixtral.py imports only apply_rotary_pos_emb from transformers: nothing to stand in for.
    assert "PixtralRotaryEmbedding," not in s, "vLLM's pixtral.py imports differ from 0.26.0's"
    print("nothing to patch in", p)

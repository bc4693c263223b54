# vLLM 0.34.0's kernel warm-up imports MiniMax-M3's MSA warm-up on every CUDA engine, and that module imports the CuTe
# DSL (`cutlass`, nvidia-cutlass-dsl), which the kit does not carry: every engine then dies at start with
# "No module named 'cutlass'". The warm-up does nothing for other models; without the DSL it is skipped.
p = '/tmp/site/vllm/model_executor/warmup/kernel_warmup.py'
s = open(p).read()
old = '''        from vllm.model_executor.warmup.minimax_m3_msa_warmup import (
            minimax_m3_msa_warmup,
        )

        minimax_m3_msa_warmup(worker)
'''
new = '''        import importlib.util

        if importlib.util.find_spec("cutlass") is not None:
            from vllm.model_executor.warmup.minimax_m3_msa_warmup import (
                minimax_m3_msa_warmup,
            )

            minimax_m3_msa_warmup(worker)
'''
if new in s:
    print("patched", p)
elif old in s:
    open(p, 'w').write(s.replace(old, new, 1))
    print("patched", p)
else:
    assert "minimax_m3_msa_warmup" not in s, "vLLM's kernel_warmup.py differs from 0.34.0's"
    print("nothing to patch in", p)

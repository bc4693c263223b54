"""`vlmstream infer` as the GPU benchmark's pipeline arm runs it: every description runs to --max-new-tokens (EOS
ignored; guided outputs still end with their document), as the offline and `vllm serve` arms' outputs do, and
vLLM's prefix caching is off unless --prefix-caching (those arms reuse images, so they must run without it). Both
are conditions of a fair comparison, not settings a user has: they reach the engine as the keywords
consumers/infer/factory.make_engine takes for benchmarks (ignore_eos, engine_kwargs).
--tower-in-this-process runs embeds mode's tower in this process, handing vLLM the image embeddings through its
public enable_mm_embeds, as the product does on a vLLM release its hooks were not checked against
(vlmstream/vllm_adapter.py): the public path, measured against the hooks on the checked release.

Usage: python3 benchmarks/gpu/bench_infer.py [--prefix-caching] [--tower-in-this-process] [vlmstream infer's options]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's packages


def fixed_length(make_engine, prefix_caching: bool):
    """``make_engine`` with the benchmark's conditions: outputs of a fixed length, prefix caching as asked."""

    def make(settings, model_path=None):
        return make_engine(settings, model_path, ignore_eos=True,
                           engine_kwargs=None if prefix_caching else {"enable_prefix_caching": False})

    return make


def tower_in_this_process(engine_class) -> None:
    """Embeds mode's tower in the consumer's process, whatever the vLLM release. Only the tower's place changes: the
    tower itself (FlashAttention 3 from the installed vLLM included) is the one the hooks run in vLLM's engine."""
    place = engine_class._set_tower_place
    engine_class._set_tower_place = lambda engine, in_engine: place(engine, False)


def main() -> None:
    from consumers.infer import factory
    from consumers.infer.vllm_engine import VllmEngine
    from vlmstream.cli.main import main as vlmstream

    args = sys.argv[1:]
    # `vlmstream infer` builds its engine by factory.make_engine, looked up when the command runs.
    factory.make_engine = fixed_length(factory.make_engine, prefix_caching="--prefix-caching" in args)
    if "--tower-in-this-process" in args:
        tower_in_this_process(VllmEngine)
    ours = ("--prefix-caching", "--tower-in-this-process")
    sys.argv = ["vlmstream", "infer", *(a for a in args if a not in ours)]
    vlmstream()


if __name__ == "__main__":  # vLLM may spawn its engine process, which imports this module again
    main()

"""How the vision blocks' Triton kernels are built: on first use, once, and only where Triton imports (it is
imported only where a CUDA tower runs; tests build the kernels under TRITON_INTERPRET=1 on the CPU)."""

from __future__ import annotations

from functools import lru_cache


def built_once_where_triton_imports(build):
    """A function returning ``build()``'s launchers, built on its first call and kept (``cache_clear`` builds them
    anew), or None where Triton cannot be imported."""

    @lru_cache(maxsize=1)
    def launchers():
        try:
            return build()
        except ImportError:
            return None

    launchers.__doc__ = f"{build.__name__}'s launchers, or None where Triton cannot be imported."
    return launchers

"""The optional installs and what each adds.

`pip install vlmstream` runs the producer, the decode fleet and the tools; the libraries that run a model come with
an extra: `cpu` (transformers on torch, for machines without a GPU and the built-in tiny model) or `gpu` (vLLM, with
the same torch and transformers parts). A command that runs a model checks for them before it starts anything, so a
light install answers with the extra to add instead of an ImportError from deep inside a stage.
"""

from __future__ import annotations

import importlib.util

# Each extra's top-level modules that the code imports (pyproject.toml's [project.optional-dependencies] installs them).
EXTRAS: dict[str, tuple[str, ...]] = {
    "cpu": ("torch", "torchvision", "transformers"),
    "gpu": ("torch", "torchvision", "transformers", "vllm"),
}


class MissingExtra(RuntimeError):
    """A command needs an extra this install lacks; the message names the pip command that adds it."""


def install_command(extra: str) -> str:
    return f"pip install 'vlmstream[{extra}]'"


def missing_modules(extra: str) -> list[str]:
    """The extra's modules that do not import here (looked up, not imported: torch alone takes seconds)."""
    missing = []
    for module in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a broken or half-removed package
            found = False
        if not found:
            missing.append(module)
    return missing


def require_model_engine(needed_by: str) -> None:
    """Raise MissingExtra unless the CPU model engine's libraries are installed (the `gpu` extra brings them too)."""
    missing = missing_modules("cpu")
    if missing:
        raise MissingExtra(
            f"{needed_by} runs a model, and this install has no model engine ({', '.join(missing)} not installed): "
            f"{install_command('cpu')} adds it (on a GPU machine: {install_command('gpu')}). The base install runs "
            "the producer, decode and the tools only.")

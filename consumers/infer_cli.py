"""Placeholder: filled in by the issue that owns this command."""

import typer


def infer(ctx: typer.Context) -> None:
    """Not built yet."""
    raise typer.Exit(2)


def tiny_model(ctx: typer.Context, path: str = typer.Argument(..., help="Folder to write the model into.")) -> None:
    """Write the tiny random-weight Qwen2.5-VL (real architecture and special-token ids; no download)."""
    from consumers.infer.tiny_model import write_tiny_model

    print(write_tiny_model(path))

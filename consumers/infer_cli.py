"""Placeholder: filled in by the issue that owns this command."""

import typer


def infer(ctx: typer.Context) -> None:
    """Not built yet."""
    raise typer.Exit(2)


def tiny_model(ctx: typer.Context) -> None:
    """Not built yet."""
    raise typer.Exit(2)

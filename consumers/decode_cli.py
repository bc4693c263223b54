"""Placeholder: filled in by the issue that owns this command."""

import typer


def decode(ctx: typer.Context) -> None:
    """Not built yet."""
    raise typer.Exit(2)

"""Placeholder: filled in by the issue that owns this command."""

import typer


def replay(ctx: typer.Context) -> None:
    """Not built yet."""
    raise typer.Exit(2)


def redrive(ctx: typer.Context) -> None:
    """Not built yet."""
    raise typer.Exit(2)


def status(ctx: typer.Context) -> None:
    """Not built yet."""
    raise typer.Exit(2)


def run(ctx: typer.Context) -> None:
    """Not built yet."""
    raise typer.Exit(2)


def bench(ctx: typer.Context) -> None:
    """Not built yet."""
    raise typer.Exit(2)

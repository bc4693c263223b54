"""Placeholder: `run` and `bench` are wired up once the stages exist."""

import typer


def run(ctx: typer.Context) -> None:
    """Not built yet."""
    raise typer.Exit(2)


def bench(ctx: typer.Context) -> None:
    """Not built yet."""
    raise typer.Exit(2)

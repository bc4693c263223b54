"""`vlmstream decode`: this machine's share of the decode consumer group."""

from __future__ import annotations

from typing import List, Optional

import typer


def decode(
    ctx: typer.Context,
    workers: Optional[int] = typer.Option(None, "--workers", "-w", help="Worker processes; 0 = one per core."),
    model: Optional[str] = typer.Option(
        None, "--model", help="Checkpoint folder of the model that infers: its config.json picks the family the "
        "images are resized for, its image processor settings the pixel limits (decode.model)."),
    max_pixels: Optional[int] = typer.Option(None, help="Largest model input (pixels) after smart_resize."),
    min_pixels: Optional[int] = typer.Option(None, help="Smallest model input (pixels) after smart_resize."),
    codec: Optional[str] = typer.Option(None, help="Payload codec: jpeg, png (lossless) or raw RGB."),
    allowed_root: Optional[List[str]] = typer.Option(
        None, "--allowed-root", help="Folder local image paths may point into (repeatable)."),
    allow_private_hosts: Optional[bool] = typer.Option(
        None, "--allow-private-hosts/--deny-private-hosts", help="Allow http(s) to loopback/private addresses."),
    exactly_once: Optional[bool] = typer.Option(
        None, "--exactly-once/--at-least-once",
        help="Transactions per batch; downstream must read with isolation_level=read_committed."),
    group_id: Optional[str] = typer.Option(None, help="Consumer group (all machines of one fleet share it)."),
    max_seconds: Optional[float] = typer.Option(None, help="Drain and stop after this many seconds."),
    until_idle_s: Optional[float] = typer.Option(
        None, help="A worker drains and stops after this many seconds without new records (batch runs, tests)."),
) -> None:
    """Consume DocumentRefs, publish one exact-size image record (or a dead letter) per image.

    SIGTERM/SIGINT: each worker finishes the document in hand, flushes, commits and leaves the group; a second
    signal stops the workers at once (nothing more committed).
    The fleet stops within 120 s whether or not the cluster answers, killing a worker still running then.
    Each flush, commit and close waits at most kafka.request_timeout_ms (30 s).
    Outputs the cluster did not acknowledge: no commit, one log line naming the bootstrap servers, exit status 1.
    """
    from vlmstream.cli.support import bootstrap, settings_from
    from vlmstream.kafka.topics import create_topics

    overrides = {"decode": {
        "workers": workers, "model": model, "max_pixels": max_pixels, "min_pixels": min_pixels, "codec": codec,
        "allowed_roots": list(allowed_root) if allowed_root else None,
        "allow_private_hosts": allow_private_hosts, "exactly_once": exactly_once, "group_id": group_id,
    }}
    settings = bootstrap(settings_from(ctx, overrides))
    create_topics(settings)

    from consumers.decode.fleet import run_fleet

    raise typer.Exit(run_fleet(settings, until_idle_s=until_idle_s, max_seconds=max_seconds))

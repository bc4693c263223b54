"""Operations on a running pipeline: `vlmstream replay`, `redrive`, `status` and `export`."""

import sys
from pathlib import Path
from typing import Optional

import typer

from vlmstream.projection.live import duration_text


def replay(
    ctx: typer.Context,
    stage: str = typer.Option(..., "--stage", help="decode, infer, results or condense."),
    to: str = typer.Option(..., "--to", help="earliest | offset:N | timestamp:ISO-8601-or-epoch-ms"),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print what would be redone; change nothing."),
) -> None:
    """Rewind a stage's consumer group so its workers redo the messages after a point (workers must be stopped)."""
    from rich.table import Table

    from vlmstream.cli.groups import IDLE_STATES
    from vlmstream.cli.replay import ReplayRefused, apply_replay, plan_replay
    from vlmstream.cli.support import bootstrap, settings_from

    console = _console()
    settings = bootstrap(settings_from(ctx))
    try:
        plan = plan_replay(settings, stage, to)
    except ValueError as exc:
        console.print(f"[red]{exc}[/]")
        raise typer.Exit(2)
    table = Table(title=f"replay {plan.stage} (group {plan.group_id}, {plan.state}, {plan.members} member(s)) "
                        f"to {plan.target}")
    for column in ("partition", "committed", "new", "end", "messages to redo", "images"):
        table.add_column(column, justify="right" if column != "partition" else "left")
    for p in plan.partitions:
        table.add_row(f"{p.tp.topic}/{p.tp.partition}", "-" if p.committed is None else str(p.committed),
                      str(p.new), str(p.end), str(p.redo), "-" if p.images is None else str(p.images))
    table.add_row("total", "", "", "", str(plan.messages), "-" if plan.images is None else str(plan.images))
    console.print(table)
    images = "" if plan.images is None else f", {plan.images} image(s)"
    print(f"to redo: {plan.messages} message(s){images}")
    if plan.members or plan.state not in IDLE_STATES:
        console.print(f"[red]refusing: group {plan.group_id} is {plan.state} with {plan.members} member(s); "
                      f"stop the {plan.stage} workers first (their next commit would undo the rewind)[/]")
        raise typer.Exit(2)
    if dry_run:
        console.print("dry run: nothing changed")
        return
    try:
        apply_replay(settings, plan)
    except ReplayRefused as exc:
        console.print(f"[red]refusing: {exc}[/]")
        raise typer.Exit(2)
    console.print(f"rewound {plan.group_id}: {plan.messages} message(s) will be redone")


def redrive(
    ctx: typer.Context,
    stage: Optional[str] = typer.Option(None, "--stage", help="Only dead letters of this stage."),
    error_kind: Optional[str] = typer.Option(None, "--error-kind", help="Only dead letters of this kind."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Count what would be republished; send nothing."),
) -> None:
    """Republish dead letters' original records to their source topic for another try."""

    from vlmstream.cli.redrive import redrive as do_redrive
    from vlmstream.cli.support import bootstrap, settings_from

    console = _console()
    settings = bootstrap(settings_from(ctx))
    report = do_redrive(settings, stage=stage, error_kind=error_kind, dry_run=dry_run)
    verb = "would republish" if dry_run else "republished"
    console.print(f"{report.selected} dead letter(s) selected; {verb} "
                  f"{sum(report.republished.values())}: {dict(report.republished)}")
    for reason, count in report.skipped.items():
        console.print(f"[yellow]skipped {count}[/]: {reason}")


def status(
    ctx: typer.Context,
    windows: str = typer.Option("300,3600", "--windows", help="Seconds, comma-separated: the throughput table's "
                                "windows (records each topic gained in the last N seconds)."),
    sample: float = typer.Option(0.0, "--sample", help="Seconds to watch the groups' commits, for each stage's "
                                 "consumption rate and the time its backlog takes at that rate (0: no sample)."),
    follow: bool = typer.Option(False, "--follow", help="Keep watching: every --every seconds, per stage images "
                                "done / total, the rate over a sliding window, an ETA range, drift, and the stage "
                                "that limits the run; until Ctrl-C."),
    every: float = typer.Option(5.0, "--every", help="Seconds between --follow's readings."),
    window: float = typer.Option(60.0, "--window", help="Seconds of --follow's sliding rate window."),
) -> None:
    """Consumer lag, group state and members per stage, and each stage's backlog in images; each topic's throughput
    over recent windows; dead-letter counts by stage and error kind. --follow: live progress per stage."""
    from rich.table import Table

    from vlmstream.cli.status import pipeline_status, pipeline_throughput, stage_bottleneck
    from vlmstream.cli.support import bootstrap, settings_from

    console = _console()
    settings = bootstrap(settings_from(ctx))
    if follow:
        _follow(settings, every, window)
        return
    try:
        window_s = tuple(int(w) for w in windows.split(",") if w.strip())
    except ValueError:
        window_s = ()
    if not window_s or min(window_s) <= 0:
        console.print(f"[red]--windows takes whole seconds above 0, comma-separated; got {windows!r}[/]")
        raise typer.Exit(2)
    stages, letters = pipeline_status(settings, sample_s=sample)
    table = Table(title="stages" + (f" (rates over a {sample:g} s sample)" if sample > 0 else ""))
    columns = ["stage", "group", "state", "members", "topic", "lag", "images"] + (
        ["consumed/s", "images/s", "backlog clears in"] if sample > 0 else [])
    for column in columns:
        table.add_column(column)
    for s in stages:
        for i, (topic, lag) in enumerate(s.lag.items()):
            first = i == 0
            row = [s.stage if first else "", s.group_id if first else "", s.state if first else "",
                   str(s.members) if first else "", topic, str(lag), _images(s) if first else ""]
            if sample > 0:
                row += [f"{s.consumed_per_s:.2f}" if first else "",
                        f"{s.images_per_s:.2f}" if first and s.images_per_s is not None else "",
                        _duration(s.eta_s) if first else ""]
            table.add_row(*row)
    console.print(table)
    if any(not s.images_exact for s in stages):
        console.print("[yellow]images marked ~ are estimated: more documents wait than could be read in time; the "
                      "count is scaled from those read[/]")
    print(f"bottleneck: {stage_bottleneck(settings, stages).why}")
    throughput = Table(title="throughput (records per second, by record time)")
    throughput.add_column("topic")
    throughput.add_column("records are")
    for w in window_s:
        throughput.add_column(f"last {_duration(w)}", justify="right")
    for row in pipeline_throughput(settings, window_s):
        throughput.add_row(row.topic, row.meaning if row.exists else f"[red]no such topic[/] ({row.meaning})",
                           *(f"{row.per_s(w):.2f}" for w in window_s))
    console.print(throughput)
    dead = Table(title=f"dead letters ({sum(letters.values())})")
    for column in ("stage", "error_kind", "count"):
        dead.add_column(column)
    for (stage, kind), count in sorted(letters.items()):
        dead.add_row(stage, kind, str(count))
    console.print(dead)


def _images(s) -> str:
    if s.images is None:
        return "-"
    return f"{'' if s.images_exact else '~'}{s.images}"


def _follow(settings, every_s: float, window_s: float) -> None:
    """Live progress lines until Ctrl-C or SIGTERM: plain lines (a log or a pipe), redrawn in place on a terminal."""
    import time

    from rich.live import Live
    from rich.text import Text

    from vlmstream.cli.backlog import LiveView, StageProbe
    from vlmstream.stopping import Stop

    stop = Stop("vlmstream status --follow").install()
    probe = StageProbe(settings)
    view = LiveView(probe, window_s=window_s)
    started = time.monotonic()
    live = Live(console=_console(), auto_refresh=False) if sys.stdout.isatty() else None
    try:
        if live is not None:
            live.start()
        while not stop.is_set():
            view.update()
            lines = [f"[{time.monotonic() - started:5.0f}s]", *view.lines()]
            if live is not None:
                live.update(Text("\n".join(lines)), refresh=True)
            else:
                print("\n".join(lines), flush=True)
            stop.wait(every_s)
    finally:
        if live is not None:
            live.stop()
        probe.close()


def _console():
    from rich.console import Console

    # Piped into a file or a log, rich would assume 80 columns and cut the tables' cells short.
    return Console() if sys.stdout.isatty() else Console(width=160)


def _duration(seconds: float | None) -> str:
    return "- (not moving)" if seconds is None else duration_text(seconds)


def export(
    ctx: typer.Context,
    out: Path = typer.Argument(..., help="Folder for the files (created; new records are added)."),
    what: str = typer.Option("descriptions,embeddings,results,deadletter,summaries", "--what",
                             help="Comma-separated: descriptions, embeddings, results, deadletter, summaries (the "
                             "last only when the cluster has the condense stage's topic)."),
    format: str = typer.Option("jsonl", "--format", help="jsonl: JSON lines, vectors in one binary file; parquet: "
                               "rolling Parquet files per kind (export.max_file_bytes), for DuckDB, pandas, polars."),
    follow: bool = typer.Option(False, "--follow", help="Keep adding records as they arrive, until Ctrl-C/SIGTERM."),
    group_id: str = typer.Option("vlmstream-export", "--group-id", help="Remembers how far the files go; another "
                                 "group id exports everything again into another folder."),
) -> None:
    """Add the output topics' records since the last export to files: JSON lines (vectors in one binary file) or
    Parquet (a file is complete on disk before its offsets are committed; no record twice, even after a kill)."""
    from vlmstream.cli.export import export as run_export
    from vlmstream.cli.support import bootstrap, settings_from
    from vlmstream.stopping import Stop

    settings = bootstrap(settings_from(ctx))
    stop = Stop("vlmstream export").install()
    try:
        report = run_export(settings, out, tuple(k.strip() for k in what.split(",") if k.strip()), format=format,
                            follow=follow, group_id=group_id, should_stop=stop.is_set)
    except (ValueError, RuntimeError) as exc:
        print(f"export: {exc}", file=sys.stderr)
        raise typer.Exit(2)
    written = ", ".join(f"{n} {kind}" for kind, n in report.written.items())
    notes = [f"{report.unreadable} unreadable record(s) left out"] if report.unreadable else []
    if report.already_on_disk:
        notes.append(f"{report.already_on_disk} already in files from a stopped run")
    print(f"appended {written}" + (f"; {'; '.join(notes)}" if notes else ""))
    for name in report.files:
        print(f"  {name}")

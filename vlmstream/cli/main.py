"""The `vlmstream` command. Each subcommand lives with the code it drives; this file wires them up.

Command modules import heavy libraries (torch, transformers, vllm) inside their functions, so
`vlmstream --help` and the Kafka-only commands start fast.
"""

from __future__ import annotations

import logging
import os
from typing import Optional

import orjson
import typer
from rich.console import Console

from vlmstream.cli.support import CliState, bootstrap, settings_from

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Kafka-native pipeline: document images -> VLM descriptions and vision embeddings.")
broker_app = typer.Typer(no_args_is_help=True, help="The project's local single-node Kafka (KRaft) broker.")
topics_app = typer.Typer(no_args_is_help=True, help="The pipeline's topics.")
app.add_typer(broker_app, name="broker")
app.add_typer(topics_app, name="topics")
console = Console(stderr=True)


@app.callback()
def main_options(
    ctx: typer.Context,
    config: Optional[str] = typer.Option(None, "--config", "-c", envvar="VLMSTREAM_CONFIG",
                                         help="Settings file (TOML, YAML or JSON)."),
    bootstrap_servers: Optional[str] = typer.Option(None, "--bootstrap-servers", "-b",
                                                    envvar="VLMSTREAM_BOOTSTRAP_SERVERS",
                                                    help="Kafka cluster; the local broker is used when unset."),
    log_level: Optional[str] = typer.Option(None, "--log-level", help="DEBUG, INFO, WARNING, ERROR."),
) -> None:
    logging.basicConfig(level=(log_level or "INFO").upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # kafka-python is chatty about transient coordinator moves; its errors still show.
    logging.getLogger("kafka").setLevel(os.environ.get("VLMSTREAM_KAFKA_LOG_LEVEL", "ERROR").upper())
    overrides: dict = {"kafka": {"bootstrap_servers": bootstrap_servers}}
    if log_level:
        overrides["log_level"] = log_level
    ctx.obj = CliState(config_file=config, overrides=overrides)


@broker_app.command("start")
def broker_start(ctx: typer.Context) -> None:
    """Provision (Maven) and start the local broker; reuse it when it already runs."""
    from vlmstream import broker

    settings = settings_from(ctx)
    console.print(f"Kafka answering on {broker.start(settings)}")


@broker_app.command("stop")
def broker_stop(ctx: typer.Context) -> None:
    """Stop the local broker cleanly."""
    from vlmstream import broker

    stopped = broker.stop(settings_from(ctx))
    console.print("stopped" if stopped else "no local broker was running")


@broker_app.command("status")
def broker_status(ctx: typer.Context) -> None:
    """Print the local broker's pid, address and whether it answers metadata requests."""
    from vlmstream import broker

    print(orjson.dumps(broker.status(settings_from(ctx)), option=orjson.OPT_INDENT_2).decode())


@topics_app.command("create")
def topics_create(
    ctx: typer.Context,
    partitions: Optional[int] = typer.Option(None, help="Partitions per topic (default from config)."),
) -> None:
    """Create the pipeline's topics from the config (idempotent); warn where existing ones differ."""
    from vlmstream.kafka.topics import create_topics

    settings = bootstrap(settings_from(ctx, {"topics": {"partitions": partitions}}))
    report = create_topics(settings)
    for name in report.created:
        console.print(f"created  {name}")
    for name in report.existing:
        console.print(f"exists   {name}")
    for warning in report.warnings:
        console.print(f"[yellow]warning[/] {warning}")


def _register_optional_commands() -> None:
    """Subcommands owned by other modules."""
    from vlmstream.cli import decode as decode_cli, infer as infer_cli, ops as ops_cli, produce as producer_cli
    from vlmstream.cli import run as pipeline_cli

    app.command("produce")(producer_cli.produce)
    app.command("decode")(decode_cli.decode)
    app.command("infer")(infer_cli.infer)
    app.command("tiny-model")(infer_cli.tiny_model)
    app.command("replay")(ops_cli.replay)
    app.command("redrive")(ops_cli.redrive)
    app.command("status")(ops_cli.status)
    app.command("export")(ops_cli.export)
    app.command("run")(pipeline_cli.run)
    app.command("bench")(pipeline_cli.bench)


_register_optional_commands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()

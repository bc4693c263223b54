"""The `vlmstream` command. Each subcommand lives with the code it drives; this file wires them up.

Command modules import heavy libraries (torch, transformers, vllm) inside their functions, so
`vlmstream --help` and the Kafka-only commands start fast, and run on the base install, which has none of them.
The commands that run a model check for its engine first (``needs_model_engine``).
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Callable, Optional

import orjson
import typer
from rich.console import Console

from vlmstream.cli.support import CliState, bootstrap, settings_from
from vlmstream.extras import MissingExtra, require_model_engine

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Kafka-native pipeline: document images -> VLM descriptions and vision embeddings.")
broker_app = typer.Typer(no_args_is_help=True, help="The project's local Kafka (KRaft): one node by default, or a "
                         "local cluster of several (--nodes, or broker.nodes in the settings).")
topics_app = typer.Typer(no_args_is_help=True, help="The pipeline's topics.")
security_app = typer.Typer(no_args_is_help=True, help="The local secured broker's principals: their ACLs and each "
                           "one's client settings (`broker start --secure` first).")
app.add_typer(broker_app, name="broker")
app.add_typer(topics_app, name="topics")
app.add_typer(security_app, name="security")
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


NODE_HELP = "One node of the cluster (from 1); default: every node."


@broker_app.command("start")
def broker_start(
    ctx: typer.Context,
    nodes: Optional[int] = typer.Option(None, "--nodes", min=1, help="Nodes: 1, the single embedded broker on "
                                        "broker.port; more, a local cluster, node N on broker.port + 2(N-1) and its "
                                        "controller on the next port (default: broker.nodes, 1)."),
    secure: bool = typer.Option(False, "--secure", help="SASL_SSL (SCRAM-SHA-512, TLS from a CA of its own), ACLs "
                                "per stage principal (broker.security = \"sasl_ssl\"), on every node of a cluster; "
                                "`vlmstream security clients DIR` then writes each principal's client settings."),
) -> None:
    """Provision (Maven) and start the local broker or cluster; reuse the nodes that already run."""
    from vlmstream.broker import lifecycle

    settings = settings_from(ctx, {"broker": {"nodes": nodes, "security": "sasl_ssl" if secure else None}})
    console.print(f"Kafka answering on {lifecycle.start(settings)}")
    if settings.broker.security == "sasl_ssl":
        console.print("secured: SASL_SSL with SCRAM-SHA-512, ACLs per principal; "
                      "`vlmstream security clients DIR` writes each principal's settings")


@broker_app.command("stop")
def broker_stop(ctx: typer.Context, node: Optional[int] = typer.Option(None, "--node", min=1, help=NODE_HELP),
                reason: str = typer.Option("", "--reason", help="Why (recorded with the stop in each node's folder, "
                                           "stops.log, with this command and its parent's).")) -> None:
    """Stop the local broker cleanly: every node of a cluster, or one."""
    from vlmstream.broker import lifecycle

    said = f"vlmstream broker stop{': ' + reason if reason else ''}"
    stopped = lifecycle.stop(settings_from(ctx), node=node, reason=said)
    console.print("stopped" if stopped else "no local broker was running")


@broker_app.command("status")
def broker_status(ctx: typer.Context,
                  node: Optional[int] = typer.Option(None, "--node", min=1, help=NODE_HELP)) -> None:
    """Print the local broker's pid, address and whether it answers metadata requests; on a cluster, each node's,
    the cluster id and the active controller."""
    from vlmstream.broker import lifecycle

    print(orjson.dumps(lifecycle.status(settings_from(ctx), node=node), option=orjson.OPT_INDENT_2).decode())


@broker_app.command("kill")
def broker_kill(ctx: typer.Context, node: int = typer.Option(..., "--node", min=1, help="The node to kill.")) -> None:
    """SIGKILL one node of the local cluster (a crash: no controlled shutdown)."""
    from vlmstream.broker import faults

    pid = faults.kill_node(settings_from(ctx), node, reason="vlmstream broker kill")
    console.print(f"node {node} (pid {pid}) killed" if pid else f"node {node} was not running")


@broker_app.command("restart")
def broker_restart(ctx: typer.Context,
                   node: int = typer.Option(..., "--node", min=1, help="The node to start again.")) -> None:
    """Start one node of the local cluster again and wait until it answers and the cluster lists it."""
    from vlmstream.broker import faults

    console.print(f"node {node} answering on {faults.restart_node(settings_from(ctx), node)}")


@topics_app.command("create")
def topics_create(
    ctx: typer.Context,
    partitions: Optional[int] = typer.Option(None, help="Partitions per topic (default from config)."),
    replication_factor: Optional[int] = typer.Option(None, min=1, help="Replicas per topic (default from config; "
                                                     "unset: min(3, brokers))."),
    min_insync_replicas: Optional[int] = typer.Option(None, min=1, help="Topic config min.insync.replicas (default "
                                                      "from config; unset: 2 from 3 replicas, else 1)."),
) -> None:
    """Create the pipeline's topics from the config (idempotent); warn where existing ones differ. On a cluster of
    three or more brokers they get 3 replicas and min.insync.replicas=2 unless configured otherwise."""
    from vlmstream.kafka.topics import create_topics

    settings = bootstrap(settings_from(ctx, {"topics": {"partitions": partitions,
                                                        "replication_factor": replication_factor,
                                                        "min_insync_replicas": min_insync_replicas}}))
    report = create_topics(settings)
    for name in report.created:
        console.print(f"created  {name}")
    for name in report.existing:
        console.print(f"exists   {name}")
    for warning in report.warnings:
        console.print(f"[yellow]warning[/] {warning}")


def _secured_settings(ctx: typer.Context):
    settings = settings_from(ctx, {"broker": {"security": "sasl_ssl"}})
    # A --config of a principal's own names the broker by its bootstrap only: take the local broker's port from it
    # (when bootstrap servers were given: the default's 9092 would override broker.port).
    host, _, port = settings.kafka.bootstrap_servers.split(",")[0].rpartition(":")
    if "bootstrap_servers" in settings.kafka.model_fields_set and port.isdigit() and \
            host in (settings.broker.host, "localhost"):
        settings = settings.model_copy(update={"broker": settings.broker.model_copy(update={"port": int(port)})})
    from vlmstream.broker import cluster

    return cluster.running_layout(settings)  # a cluster running on that base port: every node's address


@security_app.command("clients")
def security_clients(
    ctx: typer.Context,
    out: str = typer.Argument(..., help="Folder for the files (made 0700; each file 0600)."),
) -> None:
    """Write each principal's client settings (admin, producer, decode, infer, tap, ops: <name>.toml) and run.toml
    (admin for run's own process, each stage's login under [kafka.principals]); use one with --config."""
    from vlmstream import security

    for name, path in security.write_client_configs(_secured_settings(ctx), out).items():
        console.print(f"{name:9} {path}")


@security_app.command("acls")
def security_acls(ctx: typer.Context) -> None:
    """Print what each stage principal may do (the ACLs `broker start --secure` creates)."""
    from vlmstream import security

    for line in security.grants_table(_secured_settings(ctx)):
        print(line)


@security_app.command("provision")
def security_provision(ctx: typer.Context) -> None:
    """Create (again) every stage principal's credential and ACLs on the running secured broker, as the admin:
    after changing topic names or group ids. Idempotent."""
    from vlmstream import security

    settings = _secured_settings(ctx)
    security.provision(settings, settings.broker.bootstrap())
    console.print(f"{len(security.acl_bindings(settings))} ACLs in place for {', '.join(security.STAGE_PRINCIPALS)}")


def needs_model_engine(name: str, command: Callable) -> Callable:
    """``command`` (the subcommand ``name``), stopping with exit status 2 and the extra to install before it starts
    anything (broker, topics, workers) when this install has no model engine. Its options and help are the
    command's own (typer reads them through ``functools.wraps``)."""

    @functools.wraps(command)
    def checked(*args, **kwargs):
        try:
            require_model_engine(f"vlmstream {name}")
        except MissingExtra as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(2)
        return command(*args, **kwargs)

    return checked


def _register_optional_commands() -> None:
    """Subcommands owned by other modules."""
    from vlmstream.cli import condense as condense_cli
    from vlmstream.cli import decode as decode_cli, infer as infer_cli, ops as ops_cli, produce as producer_cli
    from vlmstream.cli import estimate as estimate_cli, run as pipeline_cli, view as view_cli

    app.command("produce")(producer_cli.produce)
    app.command("decode")(decode_cli.decode)
    app.command("infer")(needs_model_engine("infer", infer_cli.infer))
    app.command("condense")(needs_model_engine("condense", condense_cli.condense))
    app.command("tiny-model")(needs_model_engine("tiny-model", infer_cli.tiny_model))
    app.command("replay")(ops_cli.replay)
    app.command("redrive")(ops_cli.redrive)
    app.command("status")(ops_cli.status)
    app.command("export")(ops_cli.export)
    app.command("view")(view_cli.view)
    app.command("run")(needs_model_engine("run", pipeline_cli.run))
    app.command("bench")(pipeline_cli.bench)
    app.command("estimate")(needs_model_engine("estimate", estimate_cli.estimate))


_register_optional_commands()


def main() -> None:
    app()


if __name__ == "__main__":
    main()

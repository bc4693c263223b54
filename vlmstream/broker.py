"""The project's own single-node Apache Kafka (KRaft) broker for development, tests and CI.

Jars come from Maven Central through ``mvn`` into ``<home>/kafka-<version>/lib`` (outside git);
storage is formatted once; the broker runs detached and is found again through its pid file, so a
second ``start`` reuses a running broker. Nothing here is used when the configured bootstrap servers
point at another cluster.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from vlmstream import security
from vlmstream.config import BrokerSettings, Settings

log = logging.getLogger(__name__)


class BrokerError(RuntimeError):
    """The local broker could not be provisioned, started or reached."""


@dataclass(frozen=True)
class BrokerPaths:
    root: Path

    @property
    def lib(self) -> Path:
        return self.root / "lib"

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def properties(self) -> Path:
        return self.root / "server.properties"

    @property
    def pid_file(self) -> Path:
        return self.root / "broker.pid"

    @property
    def log_file(self) -> Path:
        return self.root / "broker.log"


def broker_paths(settings: BrokerSettings) -> BrokerPaths:
    return BrokerPaths(Path(settings.home).expanduser() / f"kafka-{settings.kafka_version}-{settings.port}")


def jar_dir(settings: BrokerSettings) -> Path:
    return Path(settings.home).expanduser() / f"kafka-{settings.kafka_version}-jars"


def provision_jars(settings: BrokerSettings) -> Path:
    """Resolve kafka_2.13 and a log4j2 SLF4J binding with Maven; idempotent."""
    target = jar_dir(settings)
    if target.exists() and any(target.glob("kafka_2.13-*.jar")):
        return target
    mvn = shutil.which("mvn")
    if not mvn:
        raise BrokerError("Maven (mvn) is needed to fetch the Kafka jars; install it or point "
                          "VLMSTREAM_BOOTSTRAP_SERVERS at an existing cluster.")
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    pom = resources.files("vlmstream.kafka").joinpath("pom.xml")
    with resources.as_file(pom) as pom_path:
        cmd = [mvn, "-q", "-B", "-f", str(pom_path), "dependency:copy-dependencies",
               f"-DoutputDirectory={tmp}", "-DincludeScope=runtime",
               f"-Dkafka.version={settings.kafka_version}"]
        log.info("fetching Kafka %s jars with Maven into %s", settings.kafka_version, target)
        result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 or not any(tmp.glob("kafka_2.13-*.jar")):
        raise BrokerError(f"mvn failed to resolve Kafka {settings.kafka_version}:\n{result.stdout[-3000:]}"
                          f"{result.stderr[-3000:]}")
    tmp.rename(target)
    return target


def _server_properties(settings: BrokerSettings, paths: BrokerPaths, max_message_bytes: int) -> str:
    host, port, cport = settings.host, settings.port, settings.controller_port
    return "\n".join([
        "process.roles=broker,controller",
        "node.id=1",
        f"controller.quorum.voters=1@{host}:{cport}",
        f"listeners=PLAINTEXT://{host}:{port},CONTROLLER://{host}:{cport}",
        f"advertised.listeners=PLAINTEXT://{host}:{port}",
        "controller.listener.names=CONTROLLER",
        "listener.security.protocol.map=CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "inter.broker.listener.name=PLAINTEXT",
        f"log.dirs={paths.data}",
        "num.partitions=1",
        # Single node: every internal topic has one replica and one in-sync replica.
        "offsets.topic.replication.factor=1",
        "offsets.topic.num.partitions=10",
        "transaction.state.log.replication.factor=1",
        "transaction.state.log.min.isr=1",
        "transaction.state.log.num.partitions=10",
        "share.coordinator.state.topic.replication.factor=1",
        "share.coordinator.state.topic.min.isr=1",
        "default.replication.factor=1",
        "min.insync.replicas=1",
        # Tests create and join groups constantly; no reason to wait for more members.
        "group.initial.rebalance.delay.ms=0",
        # Image payloads are large; the claim-check store takes anything above this.
        f"message.max.bytes={max_message_bytes + 1024 * 1024}",
        f"replica.fetch.max.bytes={max_message_bytes + 1024 * 1024}",
        f"socket.request.max.bytes={max(104857600, 2 * max_message_bytes)}",
        "auto.create.topics.enable=true",
        "delete.topic.enable=true",
        "log.retention.hours=168",
        "",
    ])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _read_pid(paths: BrokerPaths) -> int | None:
    try:
        pid = int(paths.pid_file.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None
    return pid if _pid_alive(pid) else None


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def broker_answers(bootstrap: str, timeout_s: float = 5.0, **client_kwargs) -> bool:
    """True when a metadata request succeeds (not just an open port); ``client_kwargs``: a secured broker's login."""
    from kafka import KafkaAdminClient

    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap.split(","), request_timeout_ms=int(timeout_s * 1000),
                                 client_id="vlmstream-probe", **client_kwargs)
    except Exception:  # noqa: BLE001 - any failure means "not answering yet"
        return False
    try:
        admin.describe_cluster()
        return True
    except Exception:  # noqa: BLE001
        return False
    finally:
        admin.close()


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and Path(java_home, "bin", "java").exists():
        return str(Path(java_home, "bin", "java"))
    java = shutil.which("java")
    if not java:
        raise BrokerError("java (17 or newer) is needed for the local Kafka broker")
    return java


def start(settings: Settings, wait_s: float = 90.0) -> str:
    """Start (or reuse) the local broker; returns its bootstrap address once it answers metadata."""
    b = settings.broker
    bootstrap = f"{b.host}:{b.port}"
    paths = broker_paths(b)
    login = security.probe_kwargs(settings)  # empty unless broker.security asks for SASL_SSL
    pid = _read_pid(paths)
    if pid is not None and broker_answers(bootstrap, **login):
        log.info("local Kafka already running (pid %s) on %s", pid, bootstrap)
        return bootstrap
    if pid is None and port_open(b.host, b.port):
        if broker_answers(bootstrap, **login):
            log.info("a Kafka broker already answers on %s; reusing it", bootstrap)
            return bootstrap
        raise BrokerError(f"port {b.port} is taken by something that is not a Kafka broker")
    lib = provision_jars(b)
    paths.root.mkdir(parents=True, exist_ok=True)
    properties = _server_properties(b, paths, settings.kafka.max_message_bytes)
    paths.properties.write_text(security.broker_properties(b, properties))  # unchanged unless broker.security
    classpath = f"{lib}/*"
    java = _java()
    if not (paths.data / "meta.properties").exists():
        cluster_id = uuid.uuid4().hex[:22]
        fmt = subprocess.run([java, "-cp", classpath, "kafka.tools.StorageTool", "format", "-t", cluster_id,
                              "-c", str(paths.properties), "--ignore-formatted", *security.format_args(b)],
                             capture_output=True, text=True)
        if fmt.returncode != 0:
            raise BrokerError(f"formatting KRaft storage failed:\n{fmt.stdout}\n{fmt.stderr}")
    log4j = resources.files("vlmstream.kafka").joinpath("log4j2.xml")
    with resources.as_file(log4j) as log4j_path:
        cmd = [java, f"-Xmx{b.heap}", f"-Xms{b.heap}", "-XX:+UseG1GC", "-Djava.awt.headless=true",
               f"-Dlog4j2.configurationFile={log4j_path}", f"-Dkafka.logs.dir={paths.root}",
               "-cp", classpath, "kafka.Kafka", str(paths.properties)]
        with open(paths.log_file, "ab") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
    paths.pid_file.write_text(str(proc.pid))
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise BrokerError(f"Kafka exited with {proc.returncode}; see {paths.log_file}:\n"
                              f"{paths.log_file.read_text()[-4000:]}")
        if port_open(b.host, b.port) and broker_answers(bootstrap, timeout_s=3, **login):
            log.info("local Kafka %s started (pid %s) on %s", b.kafka_version, proc.pid, bootstrap)
            if security.enabled(b):
                security.provision(settings, bootstrap)  # stage principals and their ACLs
            return bootstrap
        time.sleep(0.5)
    stop(settings)
    raise BrokerError(f"Kafka did not answer within {wait_s:.0f}s; see {paths.log_file}")


def stop(settings: Settings, wait_s: float = 30.0) -> bool:
    """Stop the local broker cleanly (SIGTERM, then SIGKILL after wait_s). True if one was running."""
    paths = broker_paths(settings.broker)
    pid = _read_pid(paths)
    if pid is None:
        return False
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and _pid_alive(pid):
        try:
            # Reap it if it is our child (the CLI case), so it does not linger as a zombie.
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.2)
    if _pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
    paths.pid_file.unlink(missing_ok=True)
    return True


def status(settings: Settings) -> dict[str, object]:
    b = settings.broker
    paths = broker_paths(b)
    bootstrap = f"{b.host}:{b.port}"
    return {
        "bootstrap": bootstrap,
        "pid": _read_pid(paths),
        "answers": broker_answers(bootstrap, timeout_s=3, **security.probe_kwargs(settings))
        if port_open(b.host, b.port) else False,
        "kafka_version": b.kafka_version,
        "home": str(paths.root),
        "log": str(paths.log_file),
    }


def ensure_broker(settings: Settings) -> str:
    """The bootstrap servers to use: the configured cluster, or the local broker started on demand."""
    if not settings.uses_local_broker:
        return settings.kafka.bootstrap_servers
    return start(settings)

"""What a node runs: the Kafka jars, fetched from Maven Central with ``mvn`` into ``<home>/kafka-<version>-jars``
(outside git) once, and a java to run them."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from importlib import resources
from pathlib import Path

from vlmstream.broker import BrokerError
from vlmstream.config import BrokerSettings

log = logging.getLogger(__name__)


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


def find_java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    if java_home and Path(java_home, "bin", "java").exists():
        return str(Path(java_home, "bin", "java"))
    java = shutil.which("java")
    if not java:
        raise BrokerError("java (17 or newer) is needed for the local Kafka broker")
    return java

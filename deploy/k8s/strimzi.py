"""Writes strimzi.yaml: a Strimzi KafkaTopic per pipeline topic and a KafkaUser per stage principal, from the
settings in configmap.yaml, the topic specs (vlmstream/kafka/topics.py) and the principals' grants
(vlmstream/security.py): the same topics `vlmstream topics create` makes and the same least-privilege ACLs
`vlmstream security provision` sets on the local secured broker.

    python deploy/k8s/strimzi.py > deploy/k8s/strimzi.yaml      (tests/test_k8s_manifests.py checks it is current)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

from vlmstream.config import load_settings  # noqa: E402
from vlmstream.kafka.topics import pipeline_topic_specs  # noqa: E402
from vlmstream.security import STAGE_PRINCIPALS, grants  # noqa: E402

CLUSTER = "vlmstream"  # the Kafka resource's name: its bootstrap service is <cluster>-kafka-bootstrap
BROKERS = 3  # the cluster's brokers: replication 3, two in sync (topics.replication for 3 brokers)
KINDS = {"topic": "topic", "group": "group", "transactional_id": "transactionalId", "cluster": "cluster"}
OPERATIONS = {"READ": "Read", "WRITE": "Write", "DESCRIBE": "Describe", "IDEMPOTENT_WRITE": "IdempotentWrite"}


def user_name(principal: str) -> str:
    """The KafkaUser (and SCRAM login) of a stage principal."""
    return f"{CLUSTER}-{principal}"


def settings_of_configmap(path: Path = HERE / "configmap.yaml"):
    """The settings a pod gets from the ConfigMap (its environment), nothing else."""
    data = yaml.safe_load(path.read_text())["data"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("VLMSTREAM_")}
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update({**clean, **data})
    try:
        return load_settings()
    finally:
        os.environ.clear()
        os.environ.update(saved)


def resources(settings) -> list[dict]:
    labels = {"strimzi.io/cluster": CLUSTER, "app.kubernetes.io/name": "vlmstream"}
    out: list[dict] = []
    for spec in pipeline_topic_specs(settings, BROKERS):
        out.append({"apiVersion": "kafka.strimzi.io/v1beta2", "kind": "KafkaTopic",
                    "metadata": {"name": spec.name, "labels": labels},
                    "spec": {"topicName": spec.name, "partitions": spec.partitions,
                             "replicas": spec.replication_factor, "config": dict(spec.configs)}})
    by_principal: dict[str, list[dict]] = {p: [] for p in STAGE_PRINCIPALS}
    for grant in grants(settings):
        resource = {"type": KINDS[grant.kind]}
        if grant.kind != "cluster":
            resource["name"] = grant.name
            resource["patternType"] = "prefix" if grant.prefixed else "literal"
        by_principal[grant.principal].append(
            {"type": "allow", "resource": resource, "operations": [OPERATIONS[o] for o in grant.operations]})
    for principal, acls in by_principal.items():
        out.append({"apiVersion": "kafka.strimzi.io/v1beta2", "kind": "KafkaUser",
                    "metadata": {"name": user_name(principal), "labels": labels},
                    "spec": {"authentication": {"type": "scram-sha-512", "password": {"valueFrom": {"secretKeyRef": {
                                 "name": "vlmstream-secrets", "key": f"{principal}-password"}}}},
                             "authorization": {"type": "simple", "acls": acls}}})
    return out


def render(settings=None) -> str:
    header = ("# Written by deploy/k8s/strimzi.py from configmap.yaml, vlmstream/kafka/topics.py and "
              "vlmstream/security.py; do not edit.\n")
    docs = resources(settings or settings_of_configmap())
    return header + yaml.safe_dump_all(docs, sort_keys=False, width=120)


if __name__ == "__main__":
    sys.stdout.write(render())

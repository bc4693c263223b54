"""deploy/k8s/: every manifest valid against Kubernetes' own schemas (kubernetes-validate, strict: an unknown field
fails) and the KEDA and Strimzi CRDs' openAPIV3Schema (deploy/k8s/crds/, vendored: no network), and the manifests
agree with the code: topics and ACLs as vlmstream/kafka/topics.py and vlmstream/security.py make them, every
setting, secret key and lag trigger pointing at something that exists."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from vlmstream.security import STAGE_PRINCIPALS, grants

K8S = Path(__file__).resolve().parents[1] / "deploy" / "k8s"
KUBERNETES_VERSIONS = ("1.29.0", "1.37.0")  # the oldest and newest minor releases the manifests are checked against
# Made by Strimzi's cluster operator for the Kafka resource named "vlmstream", not by these manifests.
MADE_BY_STRIMZI = {"vlmstream-cluster-ca-cert"}


def _strimzi_module():
    spec = importlib.util.spec_from_file_location("deploy_k8s_strimzi", K8S / "strimzi.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


STRIMZI = _strimzi_module()


def _docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


MANIFESTS = sorted(K8S.glob("*.yaml"))
ALL = [(p.name, d) for p in MANIFESTS for d in _docs(p)]


def _by_kind(kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for _, d in ALL if d["kind"] == kind}


def _strict(schema: dict) -> dict:
    """A CRD's structural schema as JSON Schema that rejects unknown fields, as the API server prunes them
    silently (a misspelt field would vanish, not fail): additionalProperties false wherever properties are listed
    and unknown fields are not preserved; int-or-string as either."""
    schema = copy.deepcopy(schema)

    def walk(node: dict) -> None:
        if node.pop("x-kubernetes-int-or-string", False):
            node.pop("type", None)
            node["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if node.pop("nullable", False) and "type" in node:
            node["type"] = [node["type"], "null"]
        preserve = node.pop("x-kubernetes-preserve-unknown-fields", False)
        for key in list(node):
            if key.startswith("x-kubernetes-"):
                node.pop(key)
        for child in node.get("properties", {}).values():
            walk(child)
        if isinstance(node.get("items"), dict):
            walk(node["items"])
        if isinstance(node.get("additionalProperties"), dict):
            walk(node["additionalProperties"])
        for key in ("anyOf", "allOf", "oneOf"):
            for child in node.get(key, []):
                walk(child)
        if "properties" in node and not preserve and "additionalProperties" not in node:
            node["additionalProperties"] = False

    walk(schema)
    return schema


def _crd_schemas() -> dict[tuple[str, str], dict]:
    schemas = {}
    for path in sorted((K8S / "crds").glob("*.yaml")):
        for crd in _docs(path):
            for version in crd["spec"]["versions"]:
                key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
                schemas[key] = _strict(version["schema"]["openAPIV3Schema"])
    return schemas


CRDS = _crd_schemas()


def _validate(doc: dict, version: str) -> None:
    key = (doc["apiVersion"], doc["kind"])
    if key in CRDS:
        jsonschema.Draft7Validator(CRDS[key]).validate(doc)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_crds_vendored_are_the_kinds_the_manifests_use():
    assert {("keda.sh/v1alpha1", "ScaledObject"), ("keda.sh/v1alpha1", "TriggerAuthentication"),
            ("kafka.strimzi.io/v1beta2", "KafkaTopic"), ("kafka.strimzi.io/v1beta2", "KafkaUser")} <= set(CRDS)
    kinds = {d["kind"] for _, d in ALL}
    assert {"ConfigMap", "Secret", "PersistentVolumeClaim", "Deployment", "ScaledObject", "TriggerAuthentication",
            "KafkaTopic", "KafkaUser"} <= kinds


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("name,doc", ALL, ids=[f"{n}:{d['kind']}/{d['metadata']['name']}" for n, d in ALL])
def test_manifest_is_valid(name, doc, version):
    _validate(doc, version)


def test_the_validation_rejects_a_misspelt_field():
    """The checks above can fail: a misspelt field in a custom resource and in a Deployment each fail."""
    scaled = copy.deepcopy(_by_kind("ScaledObject")["vlmstream-decode"])
    scaled["spec"]["maxReplicas"] = scaled["spec"].pop("maxReplicaCount")
    with pytest.raises(jsonschema.ValidationError, match="maxReplicas"):
        _validate(scaled, KUBERNETES_VERSIONS[-1])
    user = copy.deepcopy(_by_kind("KafkaUser")["vlmstream-decode"])
    user["spec"]["authorization"]["acls"][0]["operations"] = ["Consume"]
    with pytest.raises(jsonschema.ValidationError):
        _validate(user, KUBERNETES_VERSIONS[-1])
    deployment = copy.deepcopy(_by_kind("Deployment")["vlmstream-decode"])
    deployment["spec"]["template"]["spec"]["containers"][0]["livenesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(deployment, KUBERNETES_VERSIONS[-1])


def test_strimzi_resources_are_current():
    """strimzi.yaml is what strimzi.py writes now: the topics and ACLs follow the code and the ConfigMap."""
    assert (K8S / "strimzi.yaml").read_text() == STRIMZI.render(), \
        "regenerate: python deploy/k8s/strimzi.py > deploy/k8s/strimzi.yaml"


def test_topics_and_users_cover_every_topic_and_principal():
    settings = STRIMZI.settings_of_configmap()
    t = settings.topics
    topics = _by_kind("KafkaTopic")
    assert set(topics) == {t.documents, t.images, t.descriptions, t.embeddings, t.results, t.summaries,
                           t.deadletter}
    assert topics[t.results]["spec"]["config"]["cleanup.policy"] == "compact"
    assert all(d["spec"]["replicas"] == 3 and d["spec"]["config"]["min.insync.replicas"] == "2"
               for d in topics.values())
    users = _by_kind("KafkaUser")
    assert set(users) == {STRIMZI.user_name(p) for p in STAGE_PRINCIPALS}
    # Least privilege: the producer writes documents and dead letters and reads nothing.
    producer_acls = users[STRIMZI.user_name("producer")]["spec"]["authorization"]["acls"]
    assert not any("Read" in acl["operations"] for acl in producer_acls)
    assert {acl["resource"].get("name") for acl in producer_acls if "Write" in acl["operations"]} == {
        t.documents, f"{t.documents}.", t.deadletter, f"{t.deadletter}."}
    assert sum(len(u["spec"]["authorization"]["acls"]) for u in users.values()) == len(grants(settings))


def test_every_reference_resolves():
    """Secret keys, ConfigMap names and usernames that the pods, the KafkaUsers and KEDA name exist and agree."""
    secret = _by_kind("Secret")["vlmstream-secrets"]
    configmap = _by_kind("ConfigMap")["vlmstream-settings"]
    keys = set(secret["stringData"])
    for user in _by_kind("KafkaUser").values():
        ref = user["spec"]["authentication"]["password"]["valueFrom"]["secretKeyRef"]
        assert ref["name"] == "vlmstream-secrets" and ref["key"] in keys
    claims = set(_by_kind("PersistentVolumeClaim"))
    for name, deployment in _by_kind("Deployment").items():
        stage = name.removeprefix("vlmstream-")
        pod = deployment["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["envFrom"] == [{"configMapRef": {"name": "vlmstream-settings"}}]
        env = {e["name"]: e for e in container["env"]}
        assert env["VLMSTREAM_KAFKA__SASL_PLAIN_USERNAME"]["value"] == STRIMZI.user_name(stage)
        assert env["VLMSTREAM_KAFKA__SASL_PLAIN_PASSWORD"]["valueFrom"]["secretKeyRef"]["key"] == f"{stage}-password"
        for e in env.values():
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["name"] == "vlmstream-secrets" and ref["key"] in keys
        for volume in pod["volumes"]:
            if "persistentVolumeClaim" in volume:
                assert volume["persistentVolumeClaim"]["claimName"] in claims
            if "secret" in volume:
                assert volume["secret"]["secretName"] in MADE_BY_STRIMZI
        # Probes on the port the settings give the metrics endpoint; the liveness probe reads that port too.
        port = int(configmap["data"]["VLMSTREAM_METRICS_PORT"])
        assert container["ports"] == [{"name": "metrics", "containerPort": port}]
        assert container["livenessProbe"]["exec"]["command"][:2] == ["vlmstream-liveness", str(port)]
        assert pod["securityContext"]["runAsNonRoot"] is True
    auth = _by_kind("TriggerAuthentication")["vlmstream-kafka-ops"]
    for ref in auth["spec"]["secretTargetRef"]:
        assert ref["name"] in MADE_BY_STRIMZI or ref["key"] in keys
    assert secret["stringData"]["ops-username"] == STRIMZI.user_name("ops")


def test_lag_triggers_follow_the_settings():
    settings = STRIMZI.settings_of_configmap()
    configmap = _by_kind("ConfigMap")["vlmstream-settings"]["data"]
    scaled = _by_kind("ScaledObject")
    for so in scaled.values():
        assert so["spec"]["scaleTargetRef"]["name"] in _by_kind("Deployment")
        for trigger in so["spec"]["triggers"]:
            assert trigger["type"] == "kafka"
            for key, value in trigger["metadata"].items():
                if key.endswith("FromEnv"):
                    assert value in configmap, f"{so['metadata']['name']}: {key} names {value}, not in the ConfigMap"
    decode = scaled["vlmstream-decode"]["spec"]
    assert decode["triggers"][0]["metadata"]["topicFromEnv"] == "VLMSTREAM_TOPICS__DOCUMENTS"
    workers = int({e["name"]: e.get("value") for e in _by_kind("Deployment")["vlmstream-decode"]["spec"]["template"]
                   ["spec"]["containers"][0]["env"]}["VLMSTREAM_DECODE__WORKERS"])
    assert decode["maxReplicaCount"] * workers <= settings.topics.partitions
    infer = scaled["vlmstream-infer"]["spec"]
    assert infer["triggers"][0]["metadata"]["topicFromEnv"] == "VLMSTREAM_TOPICS__IMAGES"
    assert infer["maxReplicaCount"] <= settings.topics.partitions
    # The results aggregator's group (consumers.results.ownership.results_group_id) keeps inference up while it reads.
    assert infer["triggers"][1]["metadata"]["consumerGroup"] == f"{settings.infer.group_id}-results"
    gpu = _by_kind("Deployment")["vlmstream-infer"]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert gpu["limits"]["nvidia.com/gpu"] == "1"
    assert json.loads(configmap["VLMSTREAM_DECODE__ALLOWED_ROOTS"]) == ["/data"]

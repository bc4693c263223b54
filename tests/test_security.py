"""Least privilege on a secured broker of this module's own (SASL_SSL, SCRAM-SHA-512, ACLs; its own home and
ports, stopped at the end): the pipeline end to end with each stage under its own principal; every refusal as the
Kafka error it is; and the passwords nowhere in logs, dead letters, `status`, metrics or reprs."""

from __future__ import annotations

import io
import logging
import os
import socket
import stat
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from kafka import KafkaAdminClient, TopicPartition
from kafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    KafkaError,
    KafkaTimeoutError,
    TopicAuthorizationFailedError,
)

from vlmstream import security
from vlmstream.broker import lifecycle
from vlmstream.broker.jars import jar_dir
from vlmstream.broker.node import broker_paths, node_paths, server_properties
from vlmstream.config import BrokerSettings, KafkaSettings, Settings, load_settings
from vlmstream.kafka.clients import make_consumer, make_producer
from vlmstream.kafka.topics import create_topics

REPO = Path(__file__).resolve().parents[1]
PORT = 39192  # clear of the default broker's 9092 and of 39092, where a secured broker started by hand usually runs

# The key of the records the ACL tests write to prove a principal may write a topic (not messages).
ACL_PROBE_KEY = b"acl-probe"


def on_the_secured_broker(test):
    """Marks a test of the module's secured broker: `kafka` (a real broker) and `slow` (it starts one)."""
    return pytest.mark.kafka(pytest.mark.slow(test))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class Secured:
    settings: Settings          # the broker's; kafka: no login
    home: Path
    passwords: dict[str, str]   # every principal's, distinctive
    clients: dict[str, Path]    # the client settings files `vlmstream security clients` writes

    def as_(self, principal: str) -> Settings:
        return load_settings(self.clients[principal])

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("VLMSTREAM_")}
        b = self.settings.broker
        env.update(VLMSTREAM_HOME=str(self.home), VLMSTREAM_BROKER__PORT=str(b.port),
                   VLMSTREAM_BROKER__CONTROLLER_PORT=str(b.controller_port), VLMSTREAM_BROKER__HEAP=b.heap,
                   VLMSTREAM_TOPICS__PARTITIONS="3", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **extra)
        return env


@pytest.fixture(scope="module")
def secured(tmp_path_factory) -> Secured:
    home = tmp_path_factory.mktemp("vlm-secured-home")
    b = BrokerSettings(home=home, port=PORT, controller_port=PORT + 1, heap="512m", security="sasl_ssl")
    shared_jars = jar_dir(load_settings().broker)
    if shared_jars.exists():  # the jars are the same for every broker: no second Maven fetch
        jar_dir(b).symlink_to(shared_jars)
    settings = Settings(broker=b, kafka=KafkaSettings(bootstrap_servers=f"127.0.0.1:{PORT}"))
    run_id = uuid.uuid4().hex[:8]
    passwords = {name: f"Pw-{name}-{run_id}-QuokkaMarmalade" for name in security.PRINCIPALS}
    security.ensure_credentials(b, passwords)
    try:
        lifecycle.start(settings)
        clients = security.write_client_configs(settings, home / "clients")
        admin = load_settings(clients["admin"])
        create_topics(admin.model_copy(update={"topics": admin.topics.model_copy(update={"partitions": 3})}))
        yield Secured(settings, home, passwords, clients)
    finally:
        lifecycle.stop(settings, reason="test_security: the secured broker, at the fixture's end")


def _bootstrap_refused(caplog, level: int = logging.WARNING, **kwargs) -> tuple[type[BaseException], str]:
    """Connect an admin client with ``kwargs``; the exception it ends with and what kafka-python logged on the way
    (its bootstrap keeps the SASL error in its log and raises a timeout)."""
    caplog.clear()
    with caplog.at_level(level, logger="kafka"), pytest.raises(KafkaError) as raised:
        KafkaAdminClient(bootstrap_servers=[f"127.0.0.1:{PORT}"], bootstrap_timeout_ms=6000,
                         request_timeout_ms=5000, client_id="vlmstream-test-refused", **kwargs).describe_cluster()
    return raised.type, "\n".join(r.getMessage() for r in caplog.records)


def _broker_log(secured: Secured) -> str:
    return broker_paths(secured.settings.broker).log_file.read_text(errors="replace")


# ------------------------------------------------------------------------------------------------- refusals

@on_the_secured_broker
def assert_group_refused(settings: Settings, group_id: str, topic: str) -> None:
    """A consumer of these settings may not join ``group_id``: its polls raise GroupAuthorizationFailedError."""
    consumer = make_consumer(settings, group_id, [topic])
    try:
        with pytest.raises(GroupAuthorizationFailedError):
            for _ in range(10):
                consumer.poll(timeout_ms=500)
    finally:
        consumer.close()


def test_no_credentials_plaintext_to_the_sasl_ssl_port_is_refused(secured: Secured, caplog):
    error, logged = _bootstrap_refused(caplog)  # PLAINTEXT, no login
    # The broker expects a TLS handshake and drops the connection: no Kafka request is ever answered.
    assert error is KafkaTimeoutError
    assert "Bootstrap connection to bootstrap-0 failed: KafkaConnectionError" in logged


@on_the_secured_broker
def test_tls_without_a_sasl_login_is_refused(secured: Secured, caplog):
    ca = str(security.security_paths(secured.settings.broker).ca_cert)
    error, logged = _bootstrap_refused(caplog, security_protocol="SSL", ssl_cafile=ca)
    # TLS is fine (our CA), but a request before the SASL handshake closes the connection.
    assert error is KafkaTimeoutError
    assert "KafkaSSLTransport" in logged and "socket disconnected" in logged


@on_the_secured_broker
def test_wrong_password_fails_authentication(secured: Secured, caplog):
    kwargs = secured.as_("decode").kafka.client_kwargs()
    kwargs.pop("bootstrap_servers"), kwargs.pop("request_timeout_ms")
    kwargs["sasl_plain_password"] = "not-the-password"
    error, logged = _bootstrap_refused(caplog, level=logging.DEBUG, **kwargs)
    assert error is KafkaTimeoutError
    # The broker rejects the SCRAM proof (the client's final message, "p=..."): it answers SaslAuthenticate with
    # SASL_AUTHENTICATION_FAILED and closes the connection. Over TLS kafka-python reads that answer in some runs
    # here (SaslAuthenticationFailedError: "invalid credentials ...") and in others only the close that follows.
    after_proof = logged[logged.index(",p="):]
    assert ("SaslAuthenticationFailedError" in after_proof and "invalid credentials with SASL mechanism "
            "SCRAM-SHA-512" in after_proof) or "socket disconnected" in after_proof, after_proof[:1500]
    assert "SaslAuthenticateResponse(version=2, error_code=0, error_message='', auth_bytes=b'v=" not in logged
    # The same client with the right password gets in.
    kwargs["sasl_plain_password"] = secured.passwords["decode"]
    KafkaAdminClient(bootstrap_servers=[f"127.0.0.1:{PORT}"], bootstrap_timeout_ms=20000, **kwargs).close()


@on_the_secured_broker
def test_decode_principal_cannot_read_results(secured: Secured):
    decode = secured.as_("decode")
    results = secured.settings.topics.results
    consumer = make_consumer(decode, None)
    try:
        with pytest.raises(TopicAuthorizationFailedError):
            consumer.end_offsets([TopicPartition(results, 0)])
    finally:
        consumer.close()
    # Subscribed in its own group: the broker keeps the topic from it (metadata refused), nothing is assigned.
    consumer = make_consumer(decode, decode.decode.group_id, [results])
    try:
        for _ in range(4):
            assert consumer.poll(timeout_ms=500) == {}
        assert consumer.assignment() == set()
        assert results in consumer._client.cluster.unauthorized_topics
    finally:
        consumer.close()


@on_the_secured_broker
def test_decode_principal_cannot_join_another_stages_group(secured: Secured):
    decode = secured.as_("decode")
    assert_group_refused(decode, decode.infer.group_id, decode.topics.documents)


@on_the_secured_broker
def test_decode_principal_cannot_write_documents(secured: Secured):
    producer = make_producer(secured.as_("decode"))
    try:
        with pytest.raises(TopicAuthorizationFailedError):
            producer.send(secured.settings.topics.documents, b"{}").get(timeout=15)
    finally:
        producer.close(timeout=2)


@on_the_secured_broker
def test_condense_principal_writes_summaries_and_dead_letters_only(secured: Secured):
    condense = secured.as_("condense")
    t = condense.topics
    producer = make_producer(condense)
    try:
        for topic in (t.summaries, t.deadletter):
            producer.send(topic, key=ACL_PROBE_KEY, value=b"{}").get(timeout=15)
        for topic in (t.results, t.descriptions):
            with pytest.raises(TopicAuthorizationFailedError):
                producer.send(topic, b"x").get(timeout=15)
    finally:
        producer.close(timeout=2)
    assert_group_refused(condense, condense.infer.group_id, t.results)


@on_the_secured_broker
def test_tap_principal_writes_nothing(secured: Secured):
    tap = secured.as_("tap")
    t = tap.topics
    # Kafka's idempotent producer (ours) asks for a producer id first: refused for a principal that writes nowhere.
    producer = make_producer(tap)
    try:
        with pytest.raises(KafkaError, match="ClusterAuthorizationFailedError"):
            producer.send(t.descriptions, b"x").get(timeout=15)
    finally:
        producer.close(timeout=2)
    producer = make_producer(tap, enable_idempotence=False, acks=1, retries=0)
    try:
        for topic in (t.documents, t.images, t.descriptions, t.embeddings, t.results, t.deadletter):
            with pytest.raises(TopicAuthorizationFailedError):
                producer.send(topic, b"x").get(timeout=15)
    finally:
        producer.close(timeout=2)
    # Nor may it take a stage's group (and with it the stage's offsets).
    assert_group_refused(tap, tap.infer.group_id, t.descriptions)
    assert ClusterAuthorizationFailedError.errno == 31  # the error the producer id request names


@on_the_secured_broker
def test_tap_principal_reads_the_outputs_in_its_own_group(secured: Secured):
    tap = secured.as_("tap")
    consumer = make_consumer(tap, f"vlmstream-tap-{uuid.uuid4().hex[:6]}", [tap.topics.descriptions])
    try:
        deadline = time.monotonic() + 30
        while not consumer.assignment() and time.monotonic() < deadline:
            consumer.poll(timeout_ms=500)
        assert consumer.assignment(), "the tap principal should be given the descriptions' partitions"
    finally:
        consumer.close()


# ------------------------------------------------------------------------------- the pipeline, and secrets

def _folder(root: Path) -> dict[str, int]:
    from PIL import Image

    layout = {"doc-a": 2, "doc-b": 1}
    for doc, count in layout.items():
        (root / doc).mkdir(parents=True)
        for index in range(count):
            Image.new("RGB", (320 + 40 * index, 240), (40 * index, 120, 200)).save(root / doc / f"{index:02d}.jpg")
    (root / "doc-b" / "99-broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not really a JPEG")
    return {"doc-a": 2, "doc-b": 2}


@pytest.mark.model
@on_the_secured_broker
def test_pipeline_end_to_end_each_stage_its_own_principal_and_no_secret_anywhere(secured: Secured, tmp_path):
    folder = tmp_path / "docs"
    expected = _folder(folder)
    metrics_port = _free_port()
    env = secured.env(VLMSTREAM_METRICS_PORT=str(metrics_port), VLMSTREAM_PRODUCER__STATE_DIR=str(tmp_path / "ledger"),
                      VLMSTREAM_INFER__BATCH_SIZE="4")
    cmd = [sys.executable, "-m", "vlmstream.cli", "--config", str(secured.clients["run"]), "run", str(folder),
           "--decode-workers", "1", "--max-pixels", str(128 * 28 * 28), "--max-new-tokens", "4", "--timeout-s", "400"]
    out = tmp_path / "run.out"
    metrics = ""
    with open(out, "wb") as sink:
        proc = subprocess.Popen(cmd, env=env, stdout=sink, stderr=subprocess.STDOUT, cwd=tmp_path)
        deadline = time.monotonic() + 480
        while proc.poll() is None and time.monotonic() < deadline:
            try:  # the decode fleet's Prometheus text, while it runs
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2) as answer:
                    metrics = answer.read().decode()
            except OSError:
                pass
            time.sleep(1)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    run_output = out.read_text(errors="replace")
    assert proc.returncode == 0, run_output[-4000:]
    assert "workers stopped: {'decode': 0, 'infer': 0}" in run_output, run_output[-2000:]

    # Every document has its result, written by the infer principal; the broken file is a dead letter.
    from schemas import DeadLetter, DocumentResult
    from tests.kafka_helpers import read_topic

    admin = secured.as_("admin")
    results = {r.doc_id: r for r in (DocumentResult.decode(rec.value)
                                     for rec in read_topic(admin, admin.topics.results, idle_s=2))}
    assert {doc: results[doc].image_count for doc in expected} == expected
    assert results["doc-a"].succeeded == 2 and results["doc-b"].failed == 1
    letters = read_topic(admin, admin.topics.deadletter, idle_s=2)
    assert any(DeadLetter.decode(rec.value).doc_id == "doc-b" for rec in letters if rec.key != ACL_PROBE_KEY)
    assert metrics and "vlmstream" in metrics, "the decode fleet's metrics were never scraped"
    # decode ran as its own principal: it could not see (so would have created) the other stages' topics.
    logs = {p.name.split("-")[0]: p.read_text(errors="replace") for p in (secured.home / "logs").glob("*.log")}
    t = admin.topics
    assert f"not allowed to create topics {t.descriptions}, {t.embeddings}, {t.results}" in logs["decode"]

    # `status` as the ops principal, with kafka-python at DEBUG (it logs its configuration there).
    status = subprocess.run([sys.executable, "-m", "vlmstream.cli", "--config", str(secured.clients["ops"]),
                             "status"], env=secured.env(VLMSTREAM_KAFKA_LOG_LEVEL="DEBUG"), capture_output=True,
                            text=True, timeout=180, cwd=tmp_path, check=False)
    assert status.returncode == 0, status.stderr[-3000:]
    assert "vlmstream-decode" in status.stdout

    run_settings = load_settings(secured.clients["run"])
    assert set(run_settings.kafka.principals) == set(security.STAGE_PRINCIPALS)
    places = {
        "the run's output": run_output,
        "the stages' logs": "\n".join(p.read_text(errors="replace") for p in (secured.home / "logs").glob("*.log")),
        "the broker's log and properties": _broker_log(secured) + broker_paths(
            secured.settings.broker).properties.read_text(),
        "the dead letters": "\n".join(repr((rec.key, rec.value, rec.headers)) for rec in letters),
        "vlmstream status": status.stdout + status.stderr,
        "the decode fleet's metrics": metrics,
        "repr(settings)": repr(run_settings) + str(run_settings) + run_settings.masked_json(),
    }
    assert (secured.home / "logs").is_dir() and places["the stages' logs"]
    for where, text in places.items():
        for principal, password in secured.passwords.items():
            assert password not in text, f"{principal}'s password appears in {where}"
            assert password.encode() not in text.encode(errors="replace")


@on_the_secured_broker
def test_ops_principal_runs_replay_and_redrive(secured: Secured, tmp_path):
    """After the pipeline (its groups stopped): replay rewinds the decode group and redrive republishes the dead
    letters, both as `ops`, which is no super user."""
    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "vlmstream.cli", "--config", str(secured.clients["ops"]), *args],
                              env=secured.env(), capture_output=True, text=True, timeout=180, cwd=tmp_path,
                              check=False)

    replay = cli("replay", "--stage", "decode", "--to", "earliest")
    assert replay.returncode == 0, replay.stdout[-2000:] + replay.stderr[-3000:]
    assert "rewound vlmstream-decode" in replay.stdout + replay.stderr
    redrive = cli("redrive", "--stage", "decode")
    assert redrive.returncode == 0, redrive.stdout[-2000:] + redrive.stderr[-3000:]
    assert "republished" in redrive.stdout + redrive.stderr
    for text in (replay.stdout, replay.stderr, redrive.stdout, redrive.stderr):
        assert all(password not in text for password in secured.passwords.values())


@on_the_secured_broker
def test_transactional_ids_are_each_stages_own(secured: Secured):
    from kafka.errors import TransactionalIdAuthorizationFailedError

    decode = secured.as_("decode")
    producer = make_producer(decode, transactional_id=f"{decode.decode.group_id}-test-0")
    try:
        producer.init_transactions()
        producer.begin_transaction()
        producer.send(decode.topics.images, b"x")
        producer.abort_transaction()
    finally:
        producer.close(timeout=2)
    producer = make_producer(decode, transactional_id=f"{decode.infer.group_id}-test-0")
    try:
        with pytest.raises(TransactionalIdAuthorizationFailedError):
            producer.init_transactions()
    finally:
        producer.close(timeout=2)


@on_the_secured_broker
def test_client_settings_files_are_private_and_hold_one_login(secured: Secured):
    for name, path in secured.clients.items():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, name
    decode = secured.clients["decode"].read_text()
    assert secured.passwords["decode"] in decode
    assert all(secured.passwords[other] not in decode for other in security.PRINCIPALS if other != "decode")
    paths = security.security_paths(secured.settings.broker)
    for private in (paths.credentials, paths.ca_key, paths.keystore, paths.secrets_properties):
        assert stat.S_IMODE(private.stat().st_mode) == 0o600, private
    assert secured.passwords["broker"] not in broker_paths(secured.settings.broker).properties.read_text()


# ------------------------------------------------------------------------------------- no broker needed

def test_run_hands_each_stage_its_own_login_only():
    from pydantic import SecretStr

    from vlmstream.cli.run_workers import as_stage
    from vlmstream.config import KafkaPrincipal

    principals = {name: KafkaPrincipal(username=name, password=SecretStr(f"pw-{name}")) for name in
                  security.STAGE_PRINCIPALS}
    settings = Settings(kafka=KafkaSettings(sasl_plain_username="admin", sasl_plain_password=SecretStr("pw-admin"),
                                            principals=principals))
    for stage in ("producer", "decode", "infer", "tap"):
        kafka = as_stage(settings, stage).kafka
        assert kafka.sasl_plain_username == stage and kafka.sasl_plain_password.get_secret_value() == f"pw-{stage}"
        assert kafka.principals == {}
    assert "pw-decode" not in repr(settings) and "pw-decode" not in settings.masked_json()


def test_grants_are_least_privilege():
    settings = Settings()
    t = settings.topics
    allowed: dict[tuple[str, str, str], set[str]] = {}
    for g in security.grants(settings):
        if not g.prefixed or g.kind != "topic":
            allowed.setdefault((g.principal, g.kind, g.name), set()).update(g.operations)
    assert "READ" in allowed[("decode", "topic", t.documents)]
    assert "WRITE" not in allowed[("decode", "topic", t.documents)]
    assert ("decode", "topic", t.results) not in allowed
    assert "WRITE" in allowed[("decode", "topic", t.images)]
    assert all("WRITE" not in ops for (who, _, _), ops in allowed.items() if who == "tap")
    assert {name for (who, kind, name) in allowed if who == "tap" and kind == "topic"} == {
        t.descriptions, t.embeddings, t.results, t.summaries, t.deadletter}
    assert not any(g.kind == "cluster" for g in security.grants(settings) if g.principal == "tap")


def test_secrets_filter_masks_what_a_library_logs():
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(security.SecretsFilter(["hunter2-secret"]))
    log = logging.getLogger("test-secrets-filter")
    log.addHandler(handler)
    log.propagate = False
    try:
        log.warning("Starting client with configuration: %s", {"sasl_plain_password": "hunter2-secret"})
    finally:
        log.removeHandler(handler)
    assert "hunter2-secret" not in stream.getvalue() and "**********" in stream.getvalue()


def test_properties_unchanged_unless_secured(tmp_path):
    b = BrokerSettings(home=tmp_path, port=39292, controller_port=39293)
    text = server_properties(b, broker_paths(b), 1 << 20)
    assert security.broker_properties(b, text) == text
    assert security.format_args(b) == []


def test_every_node_of_a_cluster_is_secured_alike(tmp_path):
    b = BrokerSettings(home=tmp_path, port=39292, nodes=3, security="sasl_ssl")
    for node in range(1, 4):
        port, cport = b.node_ports(node)
        text = security.broker_properties(b, server_properties(b, node_paths(b, node), 1 << 20,
                                                                     node=node))
        assert f"listeners=SASL_SSL://127.0.0.1:{port},CONTROLLER://127.0.0.1:{cport}" in text
        assert f"advertised.listeners=SASL_SSL://127.0.0.1:{port}" in text and "PLAINTEXT" not in text
        assert "listener.name.controller.ssl.client.auth=required" in text and "password" not in text
    assert len(security.format_args(b)) == 4  # --add-scram for admin and broker, on every node's format
    # The cluster's secrets are its own, not the single node's on the same port; its clients list every node.
    single = b.model_copy(update={"nodes": 1})
    assert security.security_paths(b).root != security.security_paths(single).root
    assert not security.enabled(single.model_copy(update={"security": "none"}))
    assert security.client_security(b, "decode")["bootstrap_servers"] == b.bootstrap()

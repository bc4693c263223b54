"""Least privilege on the local broker: TLS from a CA of its own, SASL/SCRAM-SHA-512 logins, ACLs per stage.

With ``broker.security = "sasl_ssl"`` (``vlmstream broker start --secure``) the local broker's client listener is
SASL_SSL and its controller listener mutual TLS; ``StandardAuthorizer`` allows nothing no ACL allows
(``allow.everyone.if.no.acl.found=false``); on a local cluster (``--nodes``), every node alike. This module owns
everything that takes: the folder of certificates and passwords (``<broker home>/security/<host>-<port>/``, a
cluster's ``...-cluster/``; mode 0700, every secret file 0600), the broker properties (``broker_properties``, called
by ``vlmstream.broker`` where it writes each node's server.properties), the SCRAM credentials added when the storage is
formatted (``format_args``), the stage principals and their ACLs (``provision``, through the admin API), and each
principal's client settings (``write_client_configs``).

Principals (the ACLs are ``acl_bindings``; LITERAL names, plus PREFIXED ``<name>.`` so ``run --fresh``'s topics and
groups are covered too):

    admin     super user: topics create/delete, users and ACLs; ``vlmstream run``'s own process
    broker    super user: the broker's inter-broker login (the controller listener knows it by its certificate)
    producer  WRITE documents, deadletter
    decode    READ documents (group decode); WRITE images, deadletter; transactional ids ``<decode group>*``
    infer     READ images (group infer), descriptions + deadletter (group infer-results: the aggregator);
              WRITE descriptions, embeddings, results, deadletter; transactional ids ``<infer group>*``
    condense  READ results (group condense); WRITE summaries, deadletter; transactional ids ``<condense group>*``
    tap       READ descriptions, embeddings, results, summaries, deadletter (groups ``vlmstream-export*``,
              ``vlmstream-tap*``)
    ops       status / replay / redrive: DESCRIBE + READ every pipeline topic, WRITE documents, images and results
              (redrive's republishing), DESCRIBE + READ the stage groups (status lists offsets; replay's offset commit
              needs READ)

Every writer also gets cluster IDEMPOTENT_WRITE (kafka-python's producers are idempotent; Kafka 3+ would accept
WRITE on a topic instead, this says so explicitly), every READ/WRITE a DESCRIBE (metadata and offsets).

No Kafka client is imported at module level: the properties and format hooks run before any client exists.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import subprocess
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vlmstream.config import BrokerSettings, Settings

if TYPE_CHECKING:
    from kafka.admin import ACL

log = logging.getLogger(__name__)

MECHANISM = "SCRAM-SHA-512"
SUPER_USERS = ("admin", "broker")
STAGE_PRINCIPALS = ("producer", "decode", "infer", "condense", "tap", "ops")
PRINCIPALS = SUPER_USERS + STAGE_PRINCIPALS
BROKER_CERT_CN = "vlmstream-broker"
TAP_GROUP_PREFIXES = ("vlmstream-export", "vlmstream-tap")


class SecurityError(RuntimeError):
    """The broker's certificates, credentials or ACLs could not be made."""


def enabled(broker: BrokerSettings) -> bool:
    """Secured when asked, and for good once it was: a broker whose home holds credentials was formatted with SCRAM
    users and ACLs, and restarting it as plaintext (a command without ``--secure``) would open it to everyone."""
    return broker.security == "sasl_ssl" or security_paths(broker).credentials.exists()


# ---------------------------------------------------------------------------------------------------------------
# The folder of certificates and passwords


@dataclass(frozen=True)
class SecurityPaths:
    root: Path

    @property
    def ca_key(self) -> Path:
        return self.root / "ca.key"

    @property
    def ca_cert(self) -> Path:
        return self.root / "ca.pem"

    @property
    def keystore(self) -> Path:
        """The broker's private key (PKCS#8) and certificate chain in one PEM file (Kafka's PEM keystore)."""
        return self.root / "broker-keystore.pem"

    @property
    def credentials(self) -> Path:
        return self.root / "credentials.json"

    @property
    def secrets_properties(self) -> Path:
        """Secrets the broker reads through its FileConfigProvider, so server.properties holds none."""
        return self.root / "broker-secrets.properties"


def security_paths(broker: BrokerSettings) -> SecurityPaths:
    """One folder per single node, another per local cluster on the same base port (its storage is another too): a
    cluster is secured for good only when it was itself formatted secured."""
    name = f"{broker.host}-{broker.port}" + ("-cluster" if broker.nodes > 1 else "")
    return SecurityPaths(Path(broker.home).expanduser() / "security" / name)


def _write_private(path: Path, text: str) -> None:
    """Write a file only this user may read, never readable by others even for a moment."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(path, 0o600)


def _openssl(*args: str, cwd: Path) -> None:
    result = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise SecurityError(f"openssl {args[0]} failed: {result.stderr[-2000:]}")


def ensure_certificates(broker: BrokerSettings) -> SecurityPaths:
    """A CA of this broker's own and a broker certificate it signed (SAN: the broker's host, 127.0.0.1, localhost;
    server and client auth, for the mutual-TLS controller listener). Made once; kept across restarts."""
    paths = security_paths(broker)
    paths.root.mkdir(parents=True, exist_ok=True)
    os.chmod(paths.root, 0o700)
    if paths.ca_cert.exists() and paths.keystore.exists():
        return paths
    old_umask = os.umask(0o077)
    try:
        with tempfile.TemporaryDirectory(dir=paths.root) as tmp:
            work = Path(tmp)
            _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
                     "-days", "3650", "-subj", "/CN=vlmstream-local-ca",
                     "-addext", "basicConstraints=critical,CA:TRUE",
                     "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=work)
            _openssl("req", "-new", "-newkey", "rsa:2048", "-nodes", "-keyout", "broker.key", "-out", "broker.csr",
                     "-subj", f"/CN={BROKER_CERT_CN}", cwd=work)
            names = {"IP:127.0.0.1", "DNS:localhost"}
            names.add(f"IP:{broker.host}" if broker.host.replace(".", "").isdigit() else f"DNS:{broker.host}")
            (work / "ext.cnf").write_text(
                f"subjectAltName={','.join(sorted(names))}\n"
                "basicConstraints=CA:FALSE\n"
                "keyUsage=critical,digitalSignature,keyEncipherment\n"
                "extendedKeyUsage=serverAuth,clientAuth\n")
            _openssl("x509", "-req", "-in", "broker.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                     "-out", "broker.pem", "-days", "825", "-sha256", "-extfile", "ext.cnf", cwd=work)
            keystore = (work / "broker.key").read_text() + (work / "broker.pem").read_text() + \
                (work / "ca.pem").read_text()
            _write_private(paths.keystore, keystore)
            _write_private(paths.ca_key, (work / "ca.key").read_text())
            (work / "ca.pem").replace(paths.ca_cert)
    finally:
        os.umask(old_umask)
    os.chmod(paths.ca_cert, 0o644)  # the CA certificate is public: clients need it
    log.info("made a CA and a broker certificate in %s", paths.root)
    return paths


def ensure_credentials(broker: BrokerSettings, passwords: dict[str, str] | None = None) -> dict[str, str]:
    """Each principal's password: kept in credentials.json (0600), a random one made for any principal without.
    ``passwords`` sets (or replaces) some; ``provision`` then hands the new ones to the broker."""
    paths = security_paths(broker)
    paths.root.mkdir(parents=True, exist_ok=True)
    os.chmod(paths.root, 0o700)
    stored: dict[str, str] = {}
    if paths.credentials.exists():
        stored = json.loads(paths.credentials.read_text())
    changed = False
    for name in PRINCIPALS:
        wanted = (passwords or {}).get(name)
        if wanted is not None and stored.get(name) != wanted:
            stored[name], changed = wanted, True
        elif name not in stored:
            stored[name], changed = secrets.token_urlsafe(24), True
    if changed or not paths.credentials.exists():
        _write_private(paths.credentials, json.dumps(stored, indent=2))
    return stored


def load_credentials(broker: BrokerSettings) -> dict[str, str]:
    path = security_paths(broker).credentials
    if not path.exists():
        raise SecurityError(f"no credentials for the secured broker in {path}: start it with "
                            "`vlmstream broker start --secure` first")
    return json.loads(path.read_text())


# ---------------------------------------------------------------------------------------------------------------
# The broker side: properties and format arguments (the two hooks where vlmstream.broker writes a node's files)


def _jaas(username: str, password: str) -> str:
    return (f'org.apache.kafka.common.security.scram.ScramLoginModule required username="{username}" '
            f'password="{password}";')


def broker_properties(broker: BrokerSettings, properties: str) -> str:
    """server.properties as ``vlmstream.broker.node.server_properties`` wrote it, secured when ``broker.security``
    asks: the PLAINTEXT listener becomes SASL_SSL (SCRAM-SHA-512, the broker's certificate), the CONTROLLER listener
    mutual TLS, the StandardAuthorizer with admin and the broker as super users and nothing allowed that no ACL
    allows.
    Unchanged when security is off. Works on any number of nodes: only listener names are rewritten."""
    if not enabled(broker):
        return properties
    paths = ensure_certificates(broker)
    credentials = ensure_credentials(broker)
    _write_private(paths.secrets_properties, "inter.broker.jaas=" + _jaas("broker", credentials["broker"]).replace(
        "\\", "\\\\") + "\n")
    secrets_ref = f"${{file:{paths.secrets_properties}:inter.broker.jaas}}"
    overrides: dict[str, str] = {
        "listener.security.protocol.map": "CONTROLLER:SSL,SASL_SSL:SASL_SSL",
        "inter.broker.listener.name": "SASL_SSL",
        "sasl.enabled.mechanisms": MECHANISM,
        "sasl.mechanism.inter.broker.protocol": MECHANISM,
        # The broker's own login, read from a 0600 file at start: server.properties holds no secret.
        "config.providers": "file",
        "config.providers.file.class": "org.apache.kafka.common.config.provider.FileConfigProvider",
        f"listener.name.sasl_ssl.{MECHANISM.lower()}.sasl.jaas.config": secrets_ref,
        "ssl.keystore.type": "PEM",
        "ssl.keystore.location": str(paths.keystore),
        "ssl.truststore.type": "PEM",
        "ssl.truststore.location": str(paths.ca_cert),
        # Controller listener: only a holder of a certificate from this CA (the broker itself) gets in.
        "listener.name.controller.ssl.client.auth": "required",
        "authorizer.class.name": "org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "super.users": ";".join([*(f"User:{name}" for name in SUPER_USERS), f"User:CN={BROKER_CERT_CN}"]),
        "allow.everyone.if.no.acl.found": "false",
        # Clients of a secured broker never create topics by asking for them.
        "auto.create.topics.enable": "false",
    }
    lines = []
    for line in properties.splitlines():
        key, sep, value = line.partition("=")
        if sep and key in ("listeners", "advertised.listeners"):
            value = value.replace("PLAINTEXT://", "SASL_SSL://")
        if sep and key in overrides:
            value = overrides.pop(key)
        lines.append(f"{key}{sep}{value}" if sep else line)
    while lines and not lines[-1]:
        lines.pop()
    lines += ["# vlmstream.security: SASL_SSL, SCRAM-SHA-512, ACLs"]
    lines += [f"{key}={value}" for key, value in overrides.items()]
    return "\n".join(lines + [""])


def format_args(broker: BrokerSettings) -> list[str]:
    """kafka-storage format's ``--add-scram`` for the two super users, so that the first admin login works before
    any user exists in the metadata log (the other principals are added through the admin API by ``provision``).
    The arguments carry the passwords: the format command runs once, with ``capture_output``, never logged."""
    if not enabled(broker):
        return []
    credentials = ensure_credentials(broker)
    args: list[str] = []
    for name in SUPER_USERS:
        args += ["--add-scram", f"{MECHANISM}=[name={name},password={credentials[name]}]"]
    return args


# ---------------------------------------------------------------------------------------------------------------
# Clients: settings per principal


def client_security(broker: BrokerSettings, principal: str, password: str | None = None) -> dict[str, Any]:
    """The ``[kafka]`` security fields of ``principal`` on the local secured broker (password revealed)."""
    if password is None:
        password = load_credentials(broker)[principal]
    return {
        "bootstrap_servers": broker.bootstrap(),  # every node of a cluster
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": MECHANISM,
        "sasl_plain_username": principal,
        "sasl_plain_password": password,
        "ssl_cafile": str(security_paths(broker).ca_cert),
    }


def probe_kwargs(settings: Settings) -> dict[str, Any]:
    """kafka-python keyword arguments for vlmstream.broker's "does it answer" probe: nothing when the local broker is
    not secured; the settings' own login when they have one; else the admin's from the credentials file."""
    if not enabled(settings.broker):
        return {}
    kafka = settings.kafka
    if kafka.security_protocol != "PLAINTEXT":
        kwargs = kafka.client_kwargs()
    else:
        admin = client_security(settings.broker, "admin", ensure_credentials(settings.broker)["admin"])
        kwargs = settings.kafka.model_copy(update=_as_kafka_fields(admin)).client_kwargs()
    kwargs.pop("bootstrap_servers", None)
    kwargs.pop("request_timeout_ms", None)
    return kwargs


def _as_kafka_fields(fields: dict[str, Any]) -> dict[str, Any]:
    from pydantic import SecretStr

    return {**fields, "sasl_plain_password": SecretStr(fields["sasl_plain_password"])}


def principal_settings(settings: Settings, principal: str) -> Settings:
    """``settings`` with the local secured broker's login of ``principal`` (and no other principal's)."""
    kafka = settings.kafka.model_copy(update={**_as_kafka_fields(client_security(settings.broker, principal)),
                                              "principals": {}})
    return settings.model_copy(update={"kafka": kafka})


def write_client_configs(settings: Settings, out_dir: str | Path) -> dict[str, Path]:
    """One TOML file per principal (``<name>.toml``, mode 0600) with its ``[kafka]`` settings, and ``run.toml``:
    the admin's login for ``vlmstream run``'s own process plus each stage's under ``[kafka.principals.*]``, which
    ``run`` hands to the stage it starts (and to nothing else). Pass a file with ``--config``."""
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    credentials = load_credentials(settings.broker)
    written: dict[str, Path] = {}
    for name in ("admin", *STAGE_PRINCIPALS):
        fields = client_security(settings.broker, name, credentials[name])
        header = (f"# vlmstream client settings of principal {name!r} on the secured broker "
                  f"{fields['bootstrap_servers']}; secret: keep this file 0600")
        body = [header, "[kafka]"]
        body += [f"{key} = {json.dumps(value)}" for key, value in fields.items()]
        path = out / f"{name}.toml"
        _write_private(path, "\n".join(body) + "\n")
        written[name] = path
    admin = client_security(settings.broker, "admin", credentials["admin"])
    body = ["# vlmstream run on the secured broker: the admin's login for run's own process (topics, progress),",
            "# each stage's own under [kafka.principals.<stage>]; secret: keep this file 0600", "[kafka]"]
    body += [f"{key} = {json.dumps(value)}" for key, value in admin.items()]
    for stage in STAGE_PRINCIPALS:
        body += ["", f"[kafka.principals.{stage}]", f"username = {json.dumps(stage)}",
                 f"password = {json.dumps(credentials[stage])}"]
    path = out / "run.toml"
    _write_private(path, "\n".join(body) + "\n")
    written["run"] = path
    return written


# ---------------------------------------------------------------------------------------------------------------
# ACLs and SCRAM users (through the admin API)


@dataclass(frozen=True)
class Grant:
    """One ACL in words: principal may ``operations`` on resource ``kind`` named ``name`` (a literal name, or a
    prefix when ``prefixed``)."""
    principal: str
    kind: str  # topic, group, transactional_id, cluster
    name: str
    operations: tuple[str, ...]
    prefixed: bool = False


def _topic_and_runs(principal: str, name: str, operations: tuple[str, ...], kind: str = "topic") -> list[Grant]:
    """The name itself and ``<name>.`` as a prefix: ``run --fresh`` names its topics and groups ``<name>.run-...``."""
    return [Grant(principal, kind, name, operations), Grant(principal, kind, f"{name}.", operations, prefixed=True)]


def _results_group(settings: Settings) -> str:
    # consumers.results.ownership.results_group_id, spelled here: the ground floor may not import a stage.
    return f"{settings.infer.group_id}-results"


def grants(settings: Settings) -> list[Grant]:
    """Every stage principal's ACLs, from the configured topic names and group ids."""
    t = settings.topics
    decode_group, infer_group = settings.decode.group_id, settings.infer.group_id
    read, write = ("READ", "DESCRIBE"), ("WRITE", "DESCRIBE")
    out: list[Grant] = []
    for principal in ("producer", "decode", "infer", "condense", "ops"):
        out.append(Grant(principal, "cluster", "kafka-cluster", ("IDEMPOTENT_WRITE",)))
    # producer: documents in, bad input lines to the dead letters.
    out += _topic_and_runs("producer", t.documents, write) + _topic_and_runs("producer", t.deadletter, write)
    # decode: documents -> images, failures to the dead letters; its group; its transactional ids.
    out += _topic_and_runs("decode", t.documents, read)
    out += _topic_and_runs("decode", t.images, write) + _topic_and_runs("decode", t.deadletter, write)
    out += _topic_and_runs("decode", decode_group, ("READ",), "group")
    out.append(Grant("decode", "transactional_id", decode_group, write, prefixed=True))
    # infer (+ the results aggregator inside it): images -> descriptions, embeddings, dead letters; the aggregator
    # reads descriptions and dead letters and writes results.
    out += _topic_and_runs("infer", t.images, read)
    for topic in (t.descriptions, t.deadletter):
        out += _topic_and_runs("infer", topic, ("READ", "WRITE", "DESCRIBE"))
    for topic in (t.embeddings, t.results):
        out += _topic_and_runs("infer", topic, write)
    out += _topic_and_runs("infer", infer_group, ("READ",), "group")
    out += _topic_and_runs("infer", _results_group(settings), ("READ",), "group")
    out.append(Grant("infer", "transactional_id", infer_group, write, prefixed=True))
    # condense: results -> summaries, failures to the dead letters; its group; its transactional ids.
    condense_group = settings.condense.group_id
    out += _topic_and_runs("condense", t.results, read)
    out += _topic_and_runs("condense", t.summaries, write) + _topic_and_runs("condense", t.deadletter, write)
    out += _topic_and_runs("condense", condense_group, ("READ",), "group")
    out.append(Grant("condense", "transactional_id", condense_group, write, prefixed=True))
    # tap: the outputs only, read; its groups (export's and any tapping reader's) by prefix.
    for topic in (t.descriptions, t.embeddings, t.results, t.summaries, t.deadletter):
        out += _topic_and_runs("tap", topic, read)
    for prefix in TAP_GROUP_PREFIXES:
        out.append(Grant("tap", "group", prefix, ("READ",), prefixed=True))
    # ops: status (offsets, group states, dead-letter counts), replay (rewinds a stopped group: OffsetCommit needs
    # group READ and topic READ), redrive (reads dead letters, republishes to documents and images).
    for topic in (t.documents, t.images, t.descriptions, t.embeddings, t.results, t.summaries, t.deadletter):
        out += _topic_and_runs("ops", topic, read)
    for topic in (t.documents, t.images, t.results):  # results: redrive sends condense's dead letters back there
        out += _topic_and_runs("ops", topic, ("WRITE",))
    for group in (decode_group, infer_group, _results_group(settings), condense_group):
        out += _topic_and_runs("ops", group, ("READ", "DESCRIBE"), "group")
    return out


def acl_bindings(settings: Settings) -> list[ACL]:
    from kafka.admin import (
        ACL,
        ACLOperation,
        ACLPermissionType,
        ACLResourcePatternType,
        ResourcePattern,
        ResourceType,
    )

    kinds = {"topic": ResourceType.TOPIC, "group": ResourceType.GROUP, "cluster": ResourceType.CLUSTER,
             "transactional_id": ResourceType.TRANSACTIONAL_ID}
    acls = []
    for g in grants(settings):
        pattern = ResourcePattern(kinds[g.kind], g.name,
                                  ACLResourcePatternType.PREFIXED if g.prefixed else ACLResourcePatternType.LITERAL)
        for operation in g.operations:
            acls.append(ACL(f"User:{g.principal}", "*", ACLOperation[operation], ACLPermissionType.ALLOW, pattern))
    return acls


def provision(settings: Settings, bootstrap: str | None = None, passwords: dict[str, str] | None = None) -> None:
    """Make (or update) every stage principal's SCRAM credential and create its ACLs, as the admin. Idempotent:
    Kafka keeps one copy of an ACL created twice, and an upserted credential replaces the old one."""
    from kafka import KafkaAdminClient
    from kafka.admin import ScramMechanism, UserScramCredentialUpsertion

    broker = settings.broker
    credentials = ensure_credentials(broker, passwords)
    admin_fields = client_security(broker, "admin", credentials["admin"])
    if bootstrap:
        admin_fields["bootstrap_servers"] = bootstrap
    kwargs = settings.kafka.model_copy(update={**_as_kafka_fields(admin_fields), "principals": {}}).client_kwargs()
    admin = KafkaAdminClient(**kwargs, client_id="vlmstream-security")
    try:
        upserts = [UserScramCredentialUpsertion(name, ScramMechanism.SCRAM_SHA_512, credentials[name])
                   for name in STAGE_PRINCIPALS]
        errors = {user: error for user, error in admin.alter_user_scram_credentials(upserts).items() if error}
        if errors:
            raise SecurityError(f"SCRAM credentials refused: {errors}")
        result = admin.create_acls(acl_bindings(settings))
        if result["failed"]:
            raise SecurityError(f"ACLs refused: {result['failed'][:5]}")
    finally:
        admin.close()
    log.info("secured broker: %d principals, %d ACLs", len(STAGE_PRINCIPALS), len(acl_bindings(settings)))


def grants_table(settings: Settings, principals: Iterable[str] = STAGE_PRINCIPALS) -> list[str]:
    """The grants as lines of text, for `vlmstream security acls` and the docs."""
    lines = []
    for g in grants(settings):
        if g.principal in principals:
            name = f"{g.name}*" if g.prefixed else g.name
            lines.append(f"{g.principal:9} {g.kind:17} {name:40} {','.join(g.operations)}")
    return lines


# ---------------------------------------------------------------------------------------------------------------
# Logs: no secret in them, whatever a library logs


class SecretsFilter(logging.Filter):
    """Masks the given secrets in every record a handler emits. kafka-python logs its whole configuration, the
    SASL password included, at DEBUG (``Starting KafkaAdminClient with configuration: ...``)."""

    MASK = "**********"

    def __init__(self, secret_values: Iterable[str]):
        super().__init__()
        self.secrets = sorted({s for s in secret_values if s and len(s) >= 4}, key=len, reverse=True)

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a record that cannot format is the logging module's to report
            return True
        if any(s in message for s in self.secrets):
            for s in self.secrets:
                message = message.replace(s, self.MASK)
            record.msg, record.args = message, None
        return True


def settings_secrets(settings: Settings) -> list[str]:
    kafka = settings.kafka
    values = [kafka.sasl_plain_password, kafka.ssl_password, *(p.password for p in kafka.principals.values())]
    return [v.get_secret_value() for v in values if v is not None]


def mask_secrets_in_logs(settings: Settings) -> None:
    """Install (or replace) a SecretsFilter with the settings' secrets on every handler of the root logger."""
    secret_values = settings_secrets(settings)
    for handler in logging.getLogger().handlers:
        for old in [f for f in handler.filters if isinstance(f, SecretsFilter)]:
            handler.removeFilter(old)
        if secret_values:
            handler.addFilter(SecretsFilter(secret_values))

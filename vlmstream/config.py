"""One typed configuration shared by every stage.

Sources, lowest to highest precedence: defaults here, a TOML/JSON/YAML file (``--config`` or
``VLMSTREAM_CONFIG``), environment variables (``VLMSTREAM_...``, nested with ``__``, e.g.
``VLMSTREAM_DECODE__MAX_PIXELS``), then command-line flags (applied by the CLI as overrides).
Secrets are ``SecretStr`` so they never appear in logs or reprs.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from vlmstream.images.pdf import DEFAULT_MAX_PAGES as DEFAULT_MAX_PDF_PAGES
from vlmstream.models.registry import DEFAULT_FAMILY, family_named, family_of

DEFAULT_BOOTSTRAP = "127.0.0.1:9092"


class KafkaPrincipal(BaseModel):
    """One stage's own SASL login (``kafka.principals.<stage>``)."""

    username: str = Field(description="SASL username of this stage's principal.")
    password: SecretStr = Field(description="Its password (masked).")


class KafkaSettings(BaseModel):
    """How to reach the cluster. Security fields pass straight through to kafka-python."""

    bootstrap_servers: str = Field(
        DEFAULT_BOOTSTRAP,
        description="Comma-separated host:port list. When it names anything but the local broker's "
        "address, no local broker is started.",
    )
    client_id: str = Field("vlmstream", description="Prefix of every client id.")
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        "PLAINTEXT", description="How clients talk to the brokers, as in kafka-python.")
    sasl_mechanism: str | None = Field(None, description="PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER")
    sasl_plain_username: str | None = Field(None, description="SASL username.")
    sasl_plain_password: SecretStr | None = Field(None, description="SASL password (masked).")
    ssl_cafile: str | None = Field(None, description="CA certificate file that signs the brokers' certificates.")
    ssl_certfile: str | None = Field(None, description="Client certificate file, for brokers that ask for one.")
    ssl_keyfile: str | None = Field(None, description="The client certificate's key file.")
    ssl_password: SecretStr | None = Field(None, description="Password of the key file (masked).")
    principals: dict[str, KafkaPrincipal] = Field(
        default_factory=dict,
        description="Per-stage SASL logins (producer, decode, infer, condense, tap, ops) that `vlmstream run` hands to "
        "the stage it starts, each only its own; the login above stays run's own. `vlmstream security clients` writes "
        "them for the local secured broker.")
    request_timeout_ms: int = Field(
        30_000, description="Longest wait for one broker request; each flush, commit and close on a stop waits at most "
        "this long.")
    max_message_bytes: int = Field(
        16 * 1024 * 1024,
        description="Largest record the pipeline produces; larger image payloads go through the claim-check store.",
    )

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments common to every kafka-python client, secrets revealed only here."""
        kwargs: dict[str, Any] = {
            "bootstrap_servers": [s.strip() for s in self.bootstrap_servers.split(",") if s.strip()],
            "security_protocol": self.security_protocol,
            "request_timeout_ms": self.request_timeout_ms,
        }
        if self.sasl_mechanism:
            kwargs["sasl_mechanism"] = self.sasl_mechanism
        if self.sasl_plain_username:
            kwargs["sasl_plain_username"] = self.sasl_plain_username
        if self.sasl_plain_password:
            kwargs["sasl_plain_password"] = self.sasl_plain_password.get_secret_value()
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            if getattr(self, name):
                kwargs[name] = getattr(self, name)
        if self.ssl_password:
            kwargs["ssl_password"] = self.ssl_password.get_secret_value()
        return kwargs

    def as_principal(self, stage: str) -> "KafkaSettings":
        """These settings with ``stage``'s own login when ``principals`` has one (and no other stage's): what a
        stage's process gets. Unchanged, less ``principals``, otherwise."""
        login = self.principals.get(stage)
        update: dict[str, Any] = {"principals": {}}
        if login is not None:
            update |= {"sasl_plain_username": login.username, "sasl_plain_password": login.password}
        return self.model_copy(update=update)


class TopicSettings(BaseModel):
    """The pipeline's topic names and how `topics create` makes them."""

    documents: str = Field("vlmstream.documents", description="One document (its image URIs) per record.")
    images: str = Field("vlmstream.images", description="One decoded image at the model's input size per record.")
    descriptions: str = Field("vlmstream.descriptions", description="One description per image.")
    embeddings: str = Field("vlmstream.embeddings", description="One vision embedding per image.")
    results: str = Field("vlmstream.results", description="One result per document (compacted, key = doc id).")
    deadletter: str = Field("vlmstream.deadletter", description="Every failure, with its reason and original record.")
    summaries: str = Field("vlmstream.summaries", description="One summary per document (the condense stage; "
                           "compacted, key = doc id): `topics create` and `run` create it; export and view skip it "
                           "while the cluster does not have it.")
    partitions: int = Field(12, description="Partitions of each topic created by `topics create`.")
    replication_factor: int | None = Field(
        None, ge=1, description="Replicas of each topic created by `topics create` and `run`; None: min(3, the "
        "brokers the cluster has), so 1 on the single local broker and 3 on a cluster of three or more.")
    min_insync_replicas: int | None = Field(
        None, ge=1, description="Topic config min.insync.replicas (with acks=all, the replicas a write needs); "
        "None: 2 when the replication factor is 3 or more, else 1. Set on the topics only on a cluster of more "
        "than one broker or when given.")
    retention_ms: int = Field(7 * 24 * 3600 * 1000, description="Retention of the data topics.")
    deadletter_retention_ms: int = Field(30 * 24 * 3600 * 1000, description="Retention of the dead-letter topic.")


class BrokerSettings(BaseModel):
    """The project's own KRaft broker (used only when bootstrap is local): one node by default, or a local cluster
    of ``nodes`` combined broker+controller nodes from the same jars."""

    kafka_version: str = Field("4.1.1", description="Kafka release whose jars the local broker runs.")
    home: Path = Field(
        Path(os.environ.get("VLMSTREAM_HOME", str(Path.home() / ".cache" / "vlmstream"))),
        description="Cache folder outside git: Kafka jars, logs, data.",
        json_schema_extra={"doc_default": "`$VLMSTREAM_HOME`, else `~/.cache/vlmstream`"},
    )
    host: str = Field("127.0.0.1", description="Address the local broker listens on.")
    port: int = Field(9092, description="The single node's client port; a cluster's first node's.")
    controller_port: int | None = Field(
        None, description="The single node's controller port; None: the port after `port` (9093 by default). A "
        "cluster's: see nodes.")
    heap: str = Field("1g", description="JVM heap of the single node.")
    nodes: int = Field(
        1, ge=1, description="1: the single embedded node. More: a local cluster, one controller quorum, node N "
        "(from 1) listening on port + 2(N-1) and its controller on the port after, data under "
        "<home>/kafka-<version>-cluster-<port>/node-N; the bootstrap then lists every node.")
    node_heap: str = Field("512m", description="JVM heap of each node of a cluster of more than one.")
    node_jvm_options: str = Field(
        "-XX:+UseSerialGC -XX:TieredStopAtLevel=1", description="JVM options of each node of a cluster of more than "
        "one: three JVMs share the machine with the pipeline, and these keep what they take small (one GC thread, "
        "no C2 compiler, which used about half the CPU of an idle node on 2 cores). Empty: the JVM's defaults.")
    security: Literal["none", "sasl_ssl"] = Field(
        "none", description="sasl_ssl: the local broker's client listener is SASL_SSL (SCRAM-SHA-512, TLS from a CA "
        "it makes), its controller listener mutual TLS, and ACLs allow each stage's principal only what the stage "
        "needs (vlmstream/security.py); on a cluster, every node so, one certificate for all. `vlmstream broker start "
        "--secure` sets it.")

    def node_ports(self, node: int) -> tuple[int, int]:
        """(client port, controller port) of one node, from 1."""
        if self.nodes == 1:
            return self.port, self.controller_port or self.port + 1
        return self.port + 2 * (node - 1), self.port + 2 * (node - 1) + 1

    def bootstrap(self) -> str:
        """Every node's client address, comma-separated."""
        return ",".join(f"{self.host}:{self.node_ports(n)[0]}" for n in range(1, self.nodes + 1))


class ProducerSettings(BaseModel):
    """`vlmstream produce` and the producer inside `vlmstream run`."""

    max_in_flight_documents: int = Field(10_000, description="Bound on sends not yet acknowledged.")
    linger_ms: int = Field(5, description="How long a batch waits for more records before it is sent.")
    compression_type: Literal["gzip", "snappy", "lz4", "zstd"] | None = Field(
        None, description="Codec of every producer's batches (none by default: image payloads are compressed already).")
    state_dir: Path | None = Field(
        None, description="Where the ledger of already-published documents lives (default: under broker home)."
    )


class DecodeSettings(BaseModel):
    """The decode fleet: fetch, decode and resize each image to the model's input size."""

    group_id: str = Field("vlmstream-decode", description="Consumer group of the whole decode fleet.")
    workers: int = Field(0, description="Worker processes on this machine; 0 means one per core.")
    niceness: int = Field(
        0, ge=0, le=19, description="Added to each worker's nice value. On a machine shared with an inference "
        "consumer, decode then takes the cores the consumer leaves: the process that feeds the model is never "
        "starved by a decode backlog running ahead. `vlmstream run` and `estimate` use 10 unless this is set.")
    model_family: str = Field(
        DEFAULT_FAMILY, description="Model family (vlmstream/models/) whose input size rule the images are resized "
        "by; its released checkpoints' pixel limits are the defaults below.")
    model: str = Field(
        "", description="Checkpoint folder whose config.json names the model family (model_family is then ignored) and "
        "whose image processor settings (processor_config.json or preprocessor_config.json) bound the pixels: "
        "min_pixels and max_pixels apply within its limits. "
        "`vlmstream run` sets it to infer.model.")
    min_pixels: int = Field(family_named(DEFAULT_FAMILY).min_pixels, description="Smallest model input in pixels.")
    max_pixels: int = Field(family_named(DEFAULT_FAMILY).max_pixels,
                            description="Largest model input in pixels (the checkpoints' 12,845,056 by default).")
    codec: Literal["jpeg", "png", "raw"] = Field("jpeg", description="Payload codec; png and raw are lossless.")
    jpeg_quality: int = Field(95, description="Quality of the jpeg payload codec.")
    allowed_roots: list[str] = Field(
        default_factory=list,
        description="Local folders that image paths may point into; empty means the current directory.",
    )
    allow_private_hosts: bool = Field(False, description="Allow http(s) to loopback/private address ranges.")
    http_connect_timeout_s: float = Field(5.0, description="http(s) fetch: longest wait for a connection.")
    http_read_timeout_s: float = Field(30.0, description="http(s) fetch: longest wait between bytes.")
    http_retries: int = Field(3, description="http(s) fetch: tries of a retriable failure (timeout, 5xx).")
    max_image_bytes: int = Field(64 * 1024 * 1024, description="Largest source file fetched.")
    max_source_pixels: int = Field(
        200_000_000, description="Decompression-bomb guard: largest source image (width x height) decoded."
    )
    decode_time_limit_s: float = Field(
        60.0, description="CPU-bomb guard: longest decode + resize + encode of one image (0: none). Applied in "
        "the process's main thread, where the decode workers run the stage; a decoder inside one C call is "
        "stopped when the call returns.",
    )
    pdf_dpi: float = Field(
        200.0, gt=0, description="A PDF page's size in pixels before the family's resize rule: its size in points "
        "at this resolution (a scanner's usual 200 dpi). The page is drawn at that size, but at most 6x the "
        "model's input size for it on each axis, and resized to the input size; max_pixels bounds it either way.")
    max_pdf_pages: int = Field(
        DEFAULT_MAX_PDF_PAGES, ge=1, description="Largest PDF (in pages) a folder source publishes page by page; a PDF named without "
        "`#page=N` that has more is a dead letter naming this setting.")
    pdf_render_time_limit_s: float = Field(
        20.0, ge=0, description="Longest render of one PDF page (0: none). The page is parsed and drawn in a "
        "child process, which is killed past it: the page is a dead letter and the worker goes on.")
    pdf_page_text_chars: int = Field(
        0, ge=0, description="Characters of a PDF page's text layer carried with its image as metadata "
        "`page_text` (0: none).")
    claim_check_url: str = Field(
        "", description="Folder or fsspec URL for payloads over the message limit (default: under broker home)."
    )
    exactly_once: bool = Field(
        False, description="Images, dead letters and offsets in one transaction per batch; downstream must read "
        "read_committed.")
    max_poll_records: int = Field(16, description="Most documents one worker takes per poll.")
    commit_interval_s: float = Field(
        1.0, description="At-least-once: flush and commit at most this often (and on revoke and shutdown)."
    )
    session_timeout_ms: int = Field(
        10_000, description="How long a silent (killed) worker keeps its partitions before the group moves them."
    )

    @field_validator("model_family")
    @classmethod
    def _known_family(cls, name: str) -> str:
        family_named(name)  # raises, naming the known families
        return name

    @field_validator("model")
    @classmethod
    def _known_checkpoint(cls, model: str) -> str:
        if model:
            family_of(model)  # raises, naming the folder or its model_type, before any worker starts
        return model


class VllmEngineSettings(BaseModel):
    """The language model engine's own settings, which inference and condense share (each section has its own
    values, under its own names: ``infer.max_model_len``, ``condense.max_model_len``)."""

    dtype: str = Field(
        "auto", description="The model's dtype: auto, bfloat16, float16 or float32. auto: vLLM's choice from the "
        "checkpoint; the transformers engine's bfloat16 on a GPU, float32 on the CPU.")
    gpu_memory_utilization: float = Field(
        0.85, description="vLLM: the share of the GPU's memory this engine takes (weights, activations, KV cache). "
        "`vlmstream infer` and `vlmstream condense` on one GPU must add up to less than 1 (e.g. infer 0.6, condense "
        "0.3).")
    max_model_len: int = Field(32768, description="vLLM: the longest sequence, prompt and output together.")
    max_num_seqs: int | None = Field(None, description="vLLM: most sequences per step; None takes vLLM's default for "
                                     "offline batch inference (its LLM class: 1024 on 70 GB+ GPUs, 256 on others).")
    max_num_batched_tokens: int | None = Field(None, description="vLLM: most tokens per step; None takes vLLM's "
                                               "offline default (16384 on 70 GB+ GPUs other than A100, else 8192).")


class InferSettings(VllmEngineSettings):
    group_id: str = "vlmstream-infer"
    engine: Literal["auto", "vllm", "transformers"] = "auto"
    mode: Literal["embeds", "pixels"] = "embeds"
    model: str = Field("", description="HF id or local folder; empty means the built-in tiny model.")
    revision: str | None = None
    prompt: str = Field("Describe this image in one or two sentences.", description="The instruction beside each "
                        "image; `{page_text}` in it becomes the image's page text (a PDF page's text layer, "
                        "decode.pdf_page_text_chars), empty where it has none.")
    prompt_id: str = "describe-v1"
    output_schema: str | None = Field(None, description="Path to a JSON Schema the output must satisfy.")
    max_new_tokens: int = 64
    temperature: float = 0.0
    max_images_in_flight: int | None = Field(None, description="Images handed to the engine and not yet back; None: "
                                             "twice the engine's batch (vLLM: its max_num_seqs), at least 256.")
    max_visual_tokens_in_flight: int = 262_144
    batch_size: int = Field(8, description="Largest batch handed to a synchronous engine at once.")
    cpu_threads: int = Field(
        0, ge=0, description="transformers engine on the CPU: torch's threads (0: torch's own choice, one per core "
        "or OMP_NUM_THREADS). `vlmstream run` and `estimate` use 1 unless this or OMP_NUM_THREADS is set: there the "
        "decode workers share the cores, and torch's threads, which wait for each other at every operation, lose "
        "whenever one of them loses its core.")
    session_timeout_ms: int = Field(
        10_000, description="How long a silent (killed) inference consumer keeps its images before the group moves "
        "them to the others (Kafka's default is 45 s). Heartbeats run on kafka-python's IO thread, so a long batch "
        "is no risk.")
    publish_embeddings: bool = True
    max_attempts: int = 3
    exactly_once: bool = False

    def images_in_flight(self, engine_batch_size: int) -> int:
        """max_images_in_flight, or unset: twice what the engine runs at once, so that finished requests are
        replaced from a queue at once; at least 256. The visual-token bound still caps large images."""
        return self.max_images_in_flight or max(256, 2 * engine_batch_size)


DEFAULT_CONDENSE_PROMPT = (
    "Below are descriptions of the {image_count} images of one document (id {doc_id}), one per line, then its "
    "metadata.\n{descriptions}\nMetadata: {metadata}\n"
    "Answer with one JSON object that follows this JSON Schema: {schema}")


class CondenseSettings(VllmEngineSettings):
    """`vlmstream condense`: one structured answer per complete document, from its image descriptions."""

    group_id: str = "vlmstream-condense"
    engine: Literal["auto", "vllm", "transformers"] = "auto"
    model: str = Field(
        "", description="HF id or local folder of the language model; empty: infer.model (one checkpoint serves both "
        "steps, its language model text only), or the built-in tiny model when that is empty too.")
    revision: str | None = None
    answer_schema: str = Field(
        "", description="JSON Schema file the answer must satisfy; empty: the built-in example (type, condition, "
        "notable_characteristics). vLLM enforces any schema its guided decoding takes; the transformers engine "
        "enforces a subset (an object of string, enum, number, integer, boolean and array-of-string properties) and "
        "refuses others at start.")
    prompt: str = Field(
        DEFAULT_CONDENSE_PROMPT, description="The instruction, a Python format string over {doc_id}, {image_count}, "
        "{metadata} (the document's metadata as JSON), {descriptions} (one line per described image: "
        "'[index] text') and {schema} (the answer schema as JSON).")
    prompt_file: str = Field("", description="A file holding the prompt template; wins over prompt when set.")
    prompt_id: str = "condense-v1"
    max_new_tokens: int = Field(128, ge=1, description="Most tokens of one answer.")
    max_prompt_tokens: int = Field(
        6144, ge=256, description="Context budget of the prompt. Descriptions over it are cut: each keeps its head, "
        "all cut in proportion to their length (the summary's `cut` field records it).")
    max_string_chars: int = Field(
        200, ge=1, description="transformers engine: longest string value of a schema property without maxLength.")
    max_array_items: int = Field(
        8, ge=1, description="transformers engine: most items of an array property without maxItems.")
    temperature: float = 0.0
    batch_size: int = Field(8, ge=1, description="transformers engine: most documents decoded together.")
    max_documents_in_flight: int | None = Field(
        None, description="Documents handed to the engine and not yet back; None: twice the engine's batch (vLLM: "
        "its max_num_seqs), at least 64.")
    max_attempts: int = 3
    exactly_once: bool = False
    session_timeout_ms: int = 10_000
    # A document's prompt (max_prompt_tokens) and its answer fit in far less than the inference engine's images.
    max_model_len: int = Field(8192, description="vLLM: the longest sequence, prompt and output together; "
                               "max_prompt_tokens and max_new_tokens must fit in it.")

    def documents_in_flight(self, engine_batch_size: int) -> int:
        return self.max_documents_in_flight or max(64, 2 * engine_batch_size)


class ExportSettings(BaseModel):
    """`vlmstream export --format parquet`."""

    max_file_bytes: int = Field(
        128 * 1024 * 1024, ge=1024, description="A Parquet file is closed once the records it holds reach this "
        "many bytes as published (JSON); compressed columns make the file itself smaller.")
    flush_interval_s: float = Field(
        60.0, gt=0, description="With --follow, files are also closed this often, so what arrived shows up.")


class ViewSettings(BaseModel):
    """`vlmstream view`: the local page that follows the output topics."""

    host: str = Field("127.0.0.1", description="Address the page listens on; 127.0.0.1 keeps it on this machine.")
    port: int = Field(8765, ge=1, le=65535, description="Port the page listens on.")
    max_images: int = Field(5000, ge=1, description="Images the page keeps (the latest), so memory stays bounded.")
    thumbnail_px: int = Field(256, ge=16, le=2048, description="Longest side of a thumbnail.")


class Settings(BaseSettings):
    """Everything a vlmstream process needs. Print it with secrets masked: ``settings.masked_json()``."""

    model_config = SettingsConfigDict(
        env_prefix="VLMSTREAM_", env_nested_delimiter="__", extra="ignore", validate_default=True
    )

    kafka: KafkaSettings = Field(default_factory=KafkaSettings)
    topics: TopicSettings = Field(default_factory=TopicSettings)
    broker: BrokerSettings = Field(default_factory=BrokerSettings)
    producer: ProducerSettings = Field(default_factory=ProducerSettings)
    decode: DecodeSettings = Field(default_factory=DecodeSettings)
    infer: InferSettings = Field(default_factory=InferSettings)
    condense: CondenseSettings = Field(default_factory=CondenseSettings)


    export: ExportSettings = Field(default_factory=ExportSettings)
    view: ViewSettings = Field(default_factory=ViewSettings)
    metrics_port: int = Field(0, description="Prometheus endpoint port; 0 disables it.")
    log_level: str = "INFO"

    def masked_json(self) -> str:
        return json.dumps(self.model_dump(mode="json"), indent=2, default=str)

    @model_validator(mode="after")
    def _cluster_bootstrap(self) -> "Settings":
        """On a local cluster the bootstrap lists every node, unless the bootstrap servers were given."""
        if self.broker.nodes > 1 and "bootstrap_servers" not in self.kafka.model_fields_set:
            self.kafka.bootstrap_servers = self.broker.bootstrap()
        return self

    @property
    def uses_local_broker(self) -> bool:
        ports = [self.broker.node_ports(n)[0] for n in range(1, self.broker.nodes + 1)]
        local = {f"{host}:{port}" for port in ports for host in (self.broker.host, "localhost")}
        servers = {s.strip() for s in self.kafka.bootstrap_servers.split(",") if s.strip()}
        return servers <= local


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _read_config_file(path: Path) -> dict[str, Any]:
    text = path.read_text()
    if path.suffix == ".toml":
        import tomllib

        return tomllib.loads(text)
    if path.suffix in (".yaml", ".yml"):
        import yaml  # transformers already depends on pyyaml

        return yaml.safe_load(text) or {}
    return json.loads(text)


def load_settings(config_file: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Settings:
    """Defaults < file < environment < overrides (flags)."""
    config_file = config_file or os.environ.get("VLMSTREAM_CONFIG")
    data: dict[str, Any] = _read_config_file(Path(config_file)) if config_file else {}
    merged = _deep_merge(_deep_merge(data, _explicit_env_values()), _drop_none(overrides or {}))
    return Settings(**merged)


def _drop_none(values: dict[str, Any]) -> dict[str, Any]:
    """Flags left unset arrive as None and must not override the file or the environment."""
    cleaned: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict):
            value = _drop_none(value)
            if value:
                cleaned[key] = value
        elif value is not None:
            cleaned[key] = value
    return cleaned


def is_settings_variable(key: str) -> bool:
    """Whether environment variable ``key`` sets a setting (``VLMSTREAM_<SECTION>__<NAME>``, ``VLMSTREAM_CONFIG``,
    ``VLMSTREAM_BOOTSTRAP_SERVERS``), as opposed to a process variable (``VLMSTREAM_HOME``, ``VLMSTREAM_PROFILE_*``)."""
    if not key.startswith("VLMSTREAM_") or key == "VLMSTREAM_HOME":
        return False
    first = key[len("VLMSTREAM_"):].lower().split("__")[0]
    return first in Settings.model_fields or first in ("config", "bootstrap_servers")


def _explicit_env_values() -> dict[str, Any]:
    values: dict[str, Any] = {}
    for key, raw in os.environ.items():
        if not key.startswith("VLMSTREAM_") or key in ("VLMSTREAM_CONFIG", "VLMSTREAM_HOME"):
            continue
        path = key[len("VLMSTREAM_") :].lower().split("__")
        if path == ["bootstrap_servers"]:
            path = ["kafka", "bootstrap_servers"]
        node = values
        for part in path[:-1]:
            node = node.setdefault(part, {})
        node[path[-1]] = _parse_env_value(raw)
    return values


def _parse_env_value(raw: str) -> Any:
    if raw[:1] in "[{":
        try:
            return json.loads(raw)
        except ValueError:
            pass
    return raw

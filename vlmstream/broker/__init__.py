"""The project's own Apache Kafka (KRaft) broker for development, tests and CI: one node by default, or a local
cluster of ``broker.nodes`` combined broker+controller nodes in one controller quorum. Nothing here is used when the
configured bootstrap servers point at another cluster.

    jars       the Kafka jars, fetched with Maven once, and a java to run them
    node       one node: its folder, server.properties, storage format, JVM and pid file; whether it answers
    stops      stopping nodes, each stop recorded with its reason and who asked
    cluster    several nodes: the layout on a base port, starting them, who leads the quorum and the partitions
    lifecycle  ``start``, ``stop``, ``status`` of the broker or cluster; ``ensure_broker`` for the commands
    faults     the API of chaos runs: ``kill_node``, ``restart_node``, ``snapshot_node_data``, ``restore_node_data``

Each imports only those above it, and ``BrokerError`` from here: no circle.

With ``broker.security = "sasl_ssl"`` (``start --secure``) ``vlmstream/security.py`` secures the single node or
every node of a cluster at four hooks: the written properties, the format arguments, the probes' login and, once
every node answers, the stage principals' provisioning.
"""


class BrokerError(RuntimeError):
    """The local broker could not be provisioned, started or reached."""

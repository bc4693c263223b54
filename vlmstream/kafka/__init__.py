"""Kafka plumbing below every runner: clients, topics, group membership, records as values, offsets and the
commit checkpoint. Stages never import it; runners and the tools above them do. `pom.xml` and `log4j2.xml` are
the local broker's Maven build and logging (vlmstream.broker)."""

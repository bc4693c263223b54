#!/bin/bash
# A minimal Java 17 runtime for the Kafka 4.1 broker (the device has no Java). Usage: bash jlink_jre.sh OUTDIR
# Modules: jdeps over the broker's jars (kafka-clients: logging, management, jgss, sasl, unsupported; kafka_2.13 and
# metrics-core: management) plus what log4j2 needs: java.beans (java.desktop) for its config listeners, xml, naming, sql,
# jdk.management.
# Checked by starting the broker with it and producing/consuming a record (scripts/gpu/broker_smoke.py).
set -euo pipefail
out=${1:?usage: jlink_jre.sh OUTDIR}
mods=${JRE_MODULES:-java.base,java.desktop,java.logging,java.management,java.naming,java.security.jgss,java.security.sasl,java.sql,java.xml,jdk.unsupported,jdk.management}
jlink=${JLINK:-$( [ -x /usr/lib/jvm/java-17-openjdk-amd64/bin/jlink ] && echo /usr/lib/jvm/java-17-openjdk-amd64/bin/jlink || command -v jlink )}
rm -rf "$out"
# --compress=0: the whole pack is zstd-compressed afterwards, which does better on uncompressed modules.
"$jlink" --add-modules "$mods" --strip-debug --no-man-pages --no-header-files --compress=0 --output "$out"
# Class-data sharing archive: faster JVM start; generated lazily when absent, so drop it to save bytes.
rm -f "$out"/lib/server/classes*.jsa
du -sh "$out"

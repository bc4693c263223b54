#!/usr/bin/env bash
# The README's first command: set up, start the local Kafka broker, and run the whole pipeline on a folder
# of images (default: a small built-in sample folder) with the embedded defaults. Extra arguments go to
# `vlmstream run` (see `.venv/bin/vlmstream run --help`). The broker keeps running afterwards so the topics
# can be inspected; `.venv/bin/vlmstream broker stop` stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/vlmstream run "$@"

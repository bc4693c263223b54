#!/usr/bin/env bash
# The README's second command: set up, start the local Kafka broker, run every CPU test, stop the broker.
# pytest's exit 5 (no tests collected) is a failure here, never a silent pass.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
. scripts/lib/broker.sh
[ -n "${VLMSTREAM_BOOTSTRAP_SERVERS:-}" ] || broker_up .venv/bin/vlmstream
set +e
.venv/bin/python -m pytest -ra "$@"
rc=$?
set -e
broker_down .venv/bin/vlmstream "scripts/test.sh: the suite is done and started this broker"
if [ "$rc" = 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$rc"

#!/usr/bin/env bash
# The README's second command: set up, start the local Kafka broker, run every CPU test, stop the broker.
# pytest's exit 5 (no tests collected) is a failure here, never a silent pass.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export PYTHONUNBUFFERED=1
started_here=0
if [ -z "${VLMSTREAM_BOOTSTRAP_SERVERS:-}" ]; then
  if ! .venv/bin/vlmstream broker status 2>/dev/null | grep -q '"answers": true'; then
    started_here=1
  fi
  .venv/bin/vlmstream broker start
fi
set +e
.venv/bin/python -m pytest -ra "$@"
rc=$?
set -e
if [ "$started_here" = 1 ]; then
  .venv/bin/vlmstream broker stop --reason "scripts/test.sh: the suite is done and started this broker" || true
fi
if [ "$rc" = 5 ]; then
  echo "test.sh: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$rc"

#!/usr/bin/env bash
# The dependency ranges' test. pyproject.toml's ranges promise that every version between their bounds works, while
# scripts/test.sh tests one set (constraints.txt). This installs vlmstream with the CPU model engine into a virtual
# environment of its own and runs the tests that load every model family end to end against the local broker:
#   latest  without constraints, as `pip install 'vlmstream[cpu]'` resolves today: the day a new release breaks the
#           pipeline, this fails, and prints which versions differ from constraints.txt;
#   lowest  at the ranges' lower bounds (constraints-lowest.txt, from
#           `uv pip compile --resolution lowest-direct --python-version 3.11 --extra cpu --extra test pyproject.toml`).
# Usage: bash scripts/test_ranges.sh latest|lowest [pytest arguments]
# The environment (.venv-latest or .venv-lowest, some 7 GB with torch) is removed afterwards, so that CI's disk holds
# one of them at a time; KEEP_VENV=1 keeps it for a rerun.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:?usage: test_ranges.sh latest|lowest [pytest arguments]}
shift
venv=".venv-$mode"
PY=${PYTHON:-python3}
[ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
case "$mode" in
  latest) "$venv/bin/python" -m pip install -q --upgrade --upgrade-strategy eager -e '.[cpu,test]' ;;
  lowest) "$venv/bin/python" -m pip install -q -c constraints-lowest.txt -e '.[cpu,test]' ;;
  *) echo "test_ranges.sh: mode must be latest or lowest, not $mode" >&2; exit 2 ;;
esac
# What this environment resolved to, where it differs from the tested set (names compared as PyPI normalises them:
# pip freeze may write importlib_resources where constraints.txt has importlib-resources).
normalised() { awk -F'==' '{ n = tolower($1); gsub(/[-_.]+/, "-", n); print n "==" $2 }' | sort; }
"$venv/bin/python" -m pip freeze --exclude-editable | normalised > "$venv/resolved.txt"
grep -v '^#' constraints.txt | normalised | comm -23 "$venv/resolved.txt" - | sed "s/^/test_ranges.sh ($mode): not in constraints.txt: /" || true

export PYTHONUNBUFFERED=1
. scripts/lib/broker.sh
[ -n "${VLMSTREAM_BOOTSTRAP_SERVERS:-}" ] || broker_up "$venv/bin/vlmstream"
set +e
"$venv/bin/python" -m pytest -ra -p no:cacheprovider "$@" \
  tests/test_tiny_model.py tests/test_families.py tests/test_engines.py \
  "tests/test_cli_run.py::test_run_describes_every_image_of_a_folder_and_reports_each_document"
rc=$?
set -e
broker_down "$venv/bin/vlmstream" "scripts/test_ranges.sh ($mode): its tests are done and it started this broker"
[ "${KEEP_VENV:-0}" = 1 ] || rm -rf "$venv"
[ "$rc" = 5 ] && { echo "test_ranges.sh: pytest collected no tests; that is a failure" >&2; exit 1; }
exit "$rc"

#!/usr/bin/env bash
# CI's step for scripts/rehearse.sh (the several-machines rehearsal with podman): installs what the rehearsal needs
# (podman, runc, debootstrap; as root, from the distribution's packages), starts the local broker, rehearses, stops
# the broker and removes the rehearsal's images (some 7 GB). A machine that cannot run containers (no root, no
# package manager, podman not working there) skips the rehearsal and says why, as the browser test skips without
# Chromium; a rehearsal that runs and loses anything fails the step.
set -uo pipefail
cd "$(dirname "$0")/.."
skip() { echo "ci_rehearse.sh: rehearsal skipped: $*" >&2; exit 0; }

missing=()
for tool in podman runc debootstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
  { command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; } || skip "needs ${missing[*]} and cannot install them here (not root, or no apt-get)"
  apt-get install -y -q podman runc debootstrap uidmap >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q podman runc debootstrap uidmap >/dev/null 2>&1; } \
    || skip "could not install podman, runc and debootstrap"
fi
conf=$(mktemp)
printf '[containers]\ndefault_ulimits = []\n[engine]\ncgroup_manager = "cgroupfs"\nruntime = "runc"\nevents_logger = "file"\n' > "$conf"
CONTAINERS_CONF=$conf podman info >/dev/null 2>&1 || { rm -f "$conf"; skip "podman does not run on this machine (podman info fails)"; }
rm -f "$conf"

. scripts/lib/broker.sh
broker_up .venv/bin/vlmstream || exit 1
timeout 1800 bash scripts/rehearse.sh
rc=$?
[ "$rc" = 124 ] && echo "ci_rehearse.sh: the rehearsal ran past 30 minutes" >&2
broker_down .venv/bin/vlmstream "scripts/ci_rehearse.sh: the rehearsal is done and this step started the broker"
# The images are rebuilt from the checkout on every run; leave the disk as it was.
images=$(podman images --format '{{.Repository}}:{{.Tag}}' 2>/dev/null | grep '^localhost/vlmstream-' || true)
[ -n "$images" ] && podman rmi -f $images >/dev/null 2>&1
podman image prune -f >/dev/null 2>&1 || true
exit "$rc"

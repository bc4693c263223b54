#!/usr/bin/env bash
# In a device command while plan_x1.sh or plan_x2.sh runs in the background: wait up to SECONDS for it to finish, then copy its
# results folder to $OUT as one archive (the device returns at most 8 files) and print where each job stands.
#   bash benchmarks/gpu/wait_plan.sh /root/res 540
RES=${1:-/root/res}
WAIT_S=${2:-540}
deadline=$(( $(date +%s) + WAIT_S ))
# A machine held idle past the device's idle release comes back fresh, without the plan: say so at once instead of
# waiting out SECONDS of device time for results that no longer exist.
if [ ! -e "$RES/jobs.tsv" ] && ! pgrep -f "[p]lan_x[12].sh" > /dev/null; then
  echo "NO PLAN on this machine ($RES has no jobs.tsv and no plan runs): it is a fresh one; stage and start again"
  exit 3
fi
while [ ! -e "$RES/DONE" ] && (( $(date +%s) < deadline )); do sleep 5; done
[ -e "$RES/DONE" ] && echo "PLAN DONE at $(cat "$RES/DONE")" || echo "PLAN RUNNING at $(date +%T)"
# A short answer on purpose: the next waiting call must start within the device's 30-s idle release, and a long
# output here has delayed it past that (twice). The whole of each log is in res.tgz.
cat "$RES/jobs.tsv" 2>/dev/null
grep -h -o 'PHASE .*' "$RES"/*.log 2>/dev/null \
  | sed -E 's/^(PHASE [^ ]+ budget=[^ ]+).*"img_per_s": ([0-9.]+).*/\1 img\/s \2/' | cut -c1-120 | sort -u
if [ -n "${OUT:-}" ]; then tar czf "$OUT/res.tgz" -C "$(dirname "$RES")" "$(basename "$RES")"; ls -la "$OUT"; fi

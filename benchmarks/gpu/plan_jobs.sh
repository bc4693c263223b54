# Sourced by plan_x1.sh and plan_x2.sh (after they set RES and END): one job of a background plan.
job() {  # job LABEL EXPECTED_S LIMIT_S CMD...: one line per job in jobs.tsv (label, rc, start, seconds)
  local label=$1 expect=$2 limit=$3; shift 3
  local start; start=$(date +%s)
  if (( start + expect > END )); then
    printf '%s\tskipped\t%s\t0\twould end %ss after the plan end\n' "$label" "$(date +%T)" $(( start + expect - END )) >> "$RES/jobs.tsv"
    return
  fi
  printf '%s\tstarted\t%s\n' "$label" "$(date +%T)" >> "$RES/jobs.tsv"
  timeout -k 30 "$limit" "$@" > "$RES/$label.log" 2>&1
  printf '%s\trc=%s\t%s\t%s\n' "$label" "$?" "$(date -d @"$start" +%T)" $(( $(date +%s) - start )) >> "$RES/jobs.tsv"
}

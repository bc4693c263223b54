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

# The A/B lists' side B: a whole older tree at /root/ab-tree (from `git archive`, with its COMMIT file).
AB_TREE=/root/ab-tree
IN_AB_TREE="env PYTHONPATH=/tmp/site:$AB_TREE python3 $AB_TREE"  # then /benchmarks/<script>: run it in that tree
ab_tree_ready() {  # ab_tree_ready LABEL: 0 with the two commits recorded, or 1 with LABEL skipped in jobs.tsv
  if [ -d "$AB_TREE" ]; then
    cp "$RES/commit.txt" "$RES/a_commit.txt"; cp "$AB_TREE/COMMIT" "$RES/b_commit.txt" 2>/dev/null
    return 0
  fi
  printf '%s\tskipped\t%s\t0\tno %s\n' "$1" "$(date +%T)" "$AB_TREE" >> "$RES/jobs.tsv"
  return 1
}

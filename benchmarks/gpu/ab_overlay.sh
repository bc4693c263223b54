#!/usr/bin/env bash
# Here, before a GPU run: the files of the pipeline's code (consumers/ vlmstream/ schemas/ producers/) as
# they were at BASE_COMMIT, for those that changed since, written under DIR at their paths. plan_x2.sh lays them
# over a copy of its snapshot, so one GPU lease runs a change and the code before it side by side.
#   bash benchmarks/gpu/ab_overlay.sh d907c5c~1 .gpu/ab
set -euo pipefail
base=$1; dir=$2
cd "$(dirname "$0")/../.."
rm -rf "$dir"; mkdir -p "$dir"
git diff --name-only "$base" HEAD -- consumers vlmstream schemas producers | while read -r path; do
  if git cat-file -e "$base:$path" 2>/dev/null; then
    mkdir -p "$dir/$(dirname "$path")"
    git show "$base:$path" > "$dir/$path"
    echo "before: $path"
  fi
done
git rev-parse --short "$base" > "$dir/BASE_COMMIT"

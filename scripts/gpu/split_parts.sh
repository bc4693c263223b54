#!/bin/bash
# Split the stream pack_device.sh built ($WORK/all.tar.zst, $WORK/imgs) into <repo>/.gpu/p1, p2, ...: parts of
# PART_MIB each, the last one the remainder, beside all.sha256 and imgs/ (a folder of its own where the remainder
# leaves no room for them). A call carries at most 64 MiB, the working tree included and counted as it sits on disk
# (whole blocks: the files' byte sizes undercount it by some 2 MiB), so the default is 64 MiB less the tracked files'
# disk usage less 1 MiB (the tree grows with benchmarks/results: a fixed 62 once left the last call 0.1 MiB over).
# Full parts rather than equal ones: each part is one staging call. Re-run alone to re-split without compressing
# again.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd); repo=$(cd "$here/../.." && pwd); work=${WORK:-/tmp/vlmstream-gpu-pack}
rm -rf "$repo"/.gpu/p[0-9]*; mkdir -p "$repo/.gpu/split"
tree_b=$(( $(git -C "$repo" ls-files -z | (cd "$repo" && du -c --files0-from=-) | tail -1 | cut -f1) * 1024 ))
limit=$(( 64 * 1048576 - tree_b - 1048576 )); [ -n "${PART_MIB:-}" ] && limit=$(( PART_MIB * 1048576 ))
imgs=$(du -sb "$work/imgs" | cut -f1)
( cd "$repo/.gpu/split" && rm -f part.* && split -b "$limit" "$work/all.tar.zst" part. )
i=0; for p in "$repo"/.gpu/split/part.*; do i=$((i + 1)); mkdir -p "$repo/.gpu/p$i"; mv "$p" "$repo/.gpu/p$i/"; done
last=$(stat -c %s "$repo"/.gpu/p$i/part.*)
if [ $(( last + imgs + 4096 )) -gt "$limit" ]; then i=$((i + 1)); mkdir -p "$repo/.gpu/p$i"; fi
rmdir "$repo/.gpu/split"
sha256sum "$work/all.tar.zst" | cut -d' ' -f1 > "$repo/.gpu/p$i/all.sha256"
cp -r "$work/imgs" "$repo/.gpu/p$i/imgs"
echo "parts (carry one folder per run call; the last one also holds all.sha256 and imgs/):"
for d in "$repo"/.gpu/p*; do du -sb "$d" | awk '{printf "  %s  %.1f MiB\n", $2, $1/1048576}'; done
echo "stream $(du -b "$work/all.tar.zst" | awk '{printf "%.1f MiB", $1/1048576}') in $i parts"

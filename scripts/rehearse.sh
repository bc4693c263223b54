#!/usr/bin/env bash
# A rehearsal of the several-machines layout on one host, with podman: every stage in a container of its own
# (its own file system), talking only through Kafka, images served over HTTP by a container of their own and the
# claim-check store a volume shared by decode and inference (as docs/deployment.md says). Then deploy/k8s's
# Deployments, ConfigMap and Secret run for real with `podman kube play`, describing a folder end to end.
#
#   bash scripts/rehearse.sh          (root, podman, debootstrap, runc; a broker on REHEARSE_BOOTSTRAP)
#
# Builds the images from a Debian base made here (debootstrap), kills a decode and an inference container mid-run,
# and checks both runs with the chaos run's independent checker (benchmarks/chaos/checker.py), and the first also by
# its results tap's files (`vlmstream export --follow` in a container of its own). Exit 1 on any loss;
# the last line is the verdict. Topics and groups are this run's own (prefix rehearsal-<id>), so a shared broker is
# left as it was apart from them. Containers use the host's network; no address but the broker's and
# 127.0.0.1 is ever a target.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
bootstrap=${REHEARSE_BOOTSTRAP:-127.0.0.1:9092}
docs=${REHEARSE_DOCS:-60}
work=$(mktemp -d /tmp/vlmstream-rehearsal-XXXXXX)
id=$(basename "$work" | tr 'A-Z' 'a-z' | tr -cd 'a-z0-9' | tail -c 7)
http_port=${REHEARSE_HTTP_PORT:-18080}
started=$(date +%s)
say() { echo "rehearse [$(( $(date +%s) - started ))s] $*" >&2; }

# podman as this machine runs it: runc, cgroupfs, no default ulimits (a containers.conf of our own).
cat > "$work/containers.conf" <<'CONF'
[containers]
default_ulimits = []
[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
events_logger = "file"
CONF
export CONTAINERS_CONF=$work/containers.conf
containers=()
cleanup() {
  for c in "${containers[@]}"; do podman rm -f -v -t 0 "$c" >/dev/null 2>&1 || true; done
  [ -f "$work/kube.yaml" ] && podman kube down "$work/kube.yaml" >/dev/null 2>&1 || true
  podman secret rm vlmstream-secrets >/dev/null 2>&1 || true
  podman volume rm -f "rehearsal-$id-claim-check" "rehearsal-$id-export" >/dev/null 2>&1 || true
  rm -rf "$work"
}
trap cleanup EXIT

# --- images ------------------------------------------------------------------------------------------------------
# The base is made once per host (a second run reuses it, and with it the build cache); `podman rmi` it to remake.
base=localhost/vlmstream-base:bookworm
if ! podman image exists "$base"; then
  say "debootstrap bookworm (minbase) -> $base"
  debootstrap --variant=minbase bookworm "$work/rootfs" http://deb.debian.org/debian >"$work/debootstrap.log" 2>&1
  # As Debian's published images: no package files or lists left in the base.
  rm -rf "$work/rootfs"/var/cache/apt/archives/*.deb "$work/rootfs"/var/cache/apt/*.bin "$work/rootfs"/var/lib/apt/lists/*
  tar -C "$work/rootfs" -c . | podman import -q - "$base" >/dev/null
  rm -rf "$work/rootfs"
fi
# A network whose TLS is intercepted by a CA of its own (PIP_CERT): pip inside the build trusts it too.
build=(podman build --network host --build-arg BASE_IMAGE="$base")
if [ -n "${PIP_CERT:-}" ] && [ -f "$PIP_CERT" ]; then
  printf '[global]\ncert = /run/vlmstream-build-ca.crt\n' > "$work/pip.conf"
  build+=(-v "$PIP_CERT:/run/vlmstream-build-ca.crt:ro" -v "$work/pip.conf:/etc/pip.conf:ro")
fi
for image in decode infer-cpu; do
  t0=$(date +%s)
  "${build[@]}" -f "$repo/docker/Dockerfile.$image" -t "localhost/vlmstream-$image:latest" "$repo" >"$work/build-$image.log" 2>&1 \
    || { tail -30 "$work/build-$image.log" >&2; exit 1; }
  say "built vlmstream-$image in $(( $(date +%s) - t0 ))s: $(podman image inspect --format '{{.Size}}' "localhost/vlmstream-$image:latest" | awk '{printf "%.0f MB", $1/1e6}')"
done
if podman run --rm localhost/vlmstream-decode:latest python -c "import torch" 2>/dev/null; then
  echo "rehearse: the decode image has torch; it should have the light install only" >&2; exit 1
fi

# --- the corpus and its plan ---------------------------------------------------------------------------------------
mkdir -p "$work/scans"
podman run --rm -i --user 0 -v "$work/scans:/out" localhost/vlmstream-decode:latest python - "$docs" "$id" "$http_port" <<'PY'
import json, random, sys
from PIL import Image
docs, run, port = int(sys.argv[1]), sys.argv[2], sys.argv[3]
rng = random.Random(7)
plan = {"documents": [], "images": 0}
lines = {"http": [], "files": []}
for d in range(docs):
    count = rng.randint(1, 4)
    names = []
    for i in range(count):
        name = f"doc{d:03d}-{i}.jpg"
        w, h = rng.randint(200, 900), rng.randint(200, 900)
        Image.new("RGB", (w, h), (rng.randrange(256), rng.randrange(256), rng.randrange(256))).save(f"/out/{name}")
        names.append(name)
    doc_id = f"rehearsal-{run}-{d:03d}"
    plan["documents"].append({"doc_id": doc_id, "image_count": count, "planted": {}})
    plan["images"] += count
    lines["http"].append({"doc_id": doc_id, "image_uris": [f"http://127.0.0.1:{port}/{n}" for n in names]})
    lines["files"].append({"doc_id": doc_id + "-k8s", "image_uris": [f"/data/{n}" for n in names]})
json.dump(plan, open("/out/plan.json", "w"))
kube_plan = {"documents": [dict(d, doc_id=d["doc_id"] + "-k8s") for d in plan["documents"]], "images": plan["images"]}
json.dump(kube_plan, open("/out/plan-k8s.json", "w"))
for kind, rows in lines.items():
    with open(f"/out/manifest-{kind}.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
PY
chmod -R a+rX "$work/scans"
images=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['images'])" "$work/scans/plan.json")

# --- part 1: one container per machine ----------------------------------------------------------------------------
prefix=rehearsal-$id
cat > "$work/env" <<ENV
VLMSTREAM_KAFKA__BOOTSTRAP_SERVERS=$bootstrap
VLMSTREAM_TOPICS__PARTITIONS=4
VLMSTREAM_TOPICS__DOCUMENTS=$prefix.documents
VLMSTREAM_TOPICS__IMAGES=$prefix.images
VLMSTREAM_TOPICS__DESCRIPTIONS=$prefix.descriptions
VLMSTREAM_TOPICS__EMBEDDINGS=$prefix.embeddings
VLMSTREAM_TOPICS__RESULTS=$prefix.results
VLMSTREAM_TOPICS__SUMMARIES=$prefix.summaries
VLMSTREAM_TOPICS__DEADLETTER=$prefix.deadletter
VLMSTREAM_DECODE__GROUP_ID=$prefix-decode
VLMSTREAM_INFER__GROUP_ID=$prefix-infer
VLMSTREAM_DECODE__CLAIM_CHECK_URL=/claim-check
VLMSTREAM_DECODE__ALLOW_PRIVATE_HOSTS=true
VLMSTREAM_DECODE__WORKERS=1
VLMSTREAM_DECODE__SESSION_TIMEOUT_MS=6000
VLMSTREAM_INFER__MAX_NEW_TOKENS=8
ENV
podman volume create "rehearsal-$id-claim-check" >/dev/null
run() {  # run NAME IMAGE [PODMAN-OPTIONS...] -- COMMAND...: a detached container on the host's network, the settings
  local name=$1 image=$2 opts=(); shift 2
  while [ "$1" != "--" ]; do opts+=("$1"); shift; done; shift
  containers+=("$name")
  podman run -d --name "$name" --network host --env-file "$work/env" "${opts[@]}" "localhost/vlmstream-$image:latest" \
    "$@" >/dev/null
}
check() {  # check PREFIX PLAN: the independent checker, from the decode image (kafka-python, schemas)
  podman run --rm --network host -v "$repo:/src:ro" -v "$work/scans:/scans:ro" -w /src localhost/vlmstream-decode:latest \
    python -m benchmarks.chaos.checker --bootstrap "$bootstrap" --prefix "$1" --plan "$2"
}
podman run --rm --network host --env-file "$work/env" localhost/vlmstream-decode:latest vlmstream topics create \
  >"$work/topics.log" 2>&1 || { cat "$work/topics.log" >&2; exit 1; }
run "$prefix-http" decode -v "$work/scans:/srv:ro" -- python -m http.server "$http_port" --bind 127.0.0.1 --directory /srv
run "$prefix-decode-1" decode -v "rehearsal-$id-claim-check:/claim-check" -- vlmstream decode
run "$prefix-decode-2" decode -v "rehearsal-$id-claim-check:/claim-check" -- vlmstream decode
run "$prefix-infer-1" infer-cpu -v "rehearsal-$id-claim-check:/claim-check" -- vlmstream infer
# The results tap: the tools image exporting the output topics to files on a volume of its own, as it goes.
podman volume create "rehearsal-$id-export" >/dev/null
run "$prefix-export" decode -v "rehearsal-$id-export:/export" -- \
  vlmstream export /export --follow --what results,deadletter --group-id "$prefix-export"
# Both decode containers in the group before any document: each then holds partitions, and work, to lose.
for _ in $(seq 1 120); do
  n=0
  for c in decode-1 decode-2; do podman logs "$prefix-$c" 2>&1 | grep ': assigned \[' >/dev/null && n=$((n + 1)); done
  [ $n = 2 ] && break
  sleep 1
done
sleep 5
run "$prefix-producer" decode -v "$work/scans:/scans:ro" -- vlmstream produce --manifest /scans/manifest-http.jsonl
say "part 1: $docs documents, $images images; producer, http, 2 decode, 1 inference, 1 export container"
# Kill a decode container once it fetches images, and the inference container once descriptions come out while
# images wait; then start a new inference container.
fetching="no fetch seen in 120 s"
for _ in $(seq 1 240); do
  # grep reads it all (no -q): an early exit would fail the pipeline (pipefail) on podman's broken pipe.
  podman logs "$prefix-decode-1" 2>&1 | grep 'HTTP Request: GET' >/dev/null && { fetching="it was fetching images"; break; }
  sleep 0.5
done
podman kill -s KILL "$prefix-decode-1" >/dev/null
ends() {  # ends TOPIC...: the sum of the topics' end offsets
  podman run --rm --network host localhost/vlmstream-decode:latest python -c '
import sys
from kafka import KafkaConsumer, TopicPartition
c = KafkaConsumer(bootstrap_servers=sys.argv[1])
tps = [TopicPartition(t, p) for t in sys.argv[2:] for p in c.partitions_for_topic(t) or ()]
print(sum(c.end_offsets(tps).values()))' "$bootstrap" "$@"
}
say "killed $prefix-decode-1 ($fetching; images topic at offset $(ends "$prefix.images") of $images images)"
for _ in $(seq 1 120); do
  described=$(ends "$prefix.descriptions")
  [ "$described" -gt 0 ] && break
  sleep 1
done
podman kill -s KILL "$prefix-infer-1" >/dev/null
say "killed $prefix-infer-1 (descriptions topic at offset $described, images topic at $(ends "$prefix.images"))"
run "$prefix-infer-2" infer-cpu -v "rehearsal-$id-claim-check:/claim-check" -- vlmstream infer
part1=1
for _ in $(seq 1 90); do
  if check "$prefix" /scans/plan.json >"$work/check1.txt" 2>&1; then part1=0; break; fi
  sleep 10
done
cat "$work/check1.txt" >&2
tap=1 exported=0
for _ in $(seq 1 24); do  # the tap's files: a result line for every planned document
  exported=$(podman run --rm -v "rehearsal-$id-export:/export:ro" -v "$work/scans:/scans:ro" \
    localhost/vlmstream-decode:latest python -c '
import json
planned = {d["doc_id"] for d in json.load(open("/scans/plan.json"))["documents"]}
try:
    exported = {json.loads(line)["doc_id"] for line in open("/export/results.jsonl")}
except FileNotFoundError:
    exported = set()
print(len(planned & exported))')
  [ "$exported" = "$docs" ] && { tap=0; break; }
  sleep 5
done
say "results tap: $exported of $docs documents' results in its files"

# --- part 2: the Kubernetes manifests with podman kube play -------------------------------------------------------
kprefix=rehearsal-$id-k8s
python3 "$repo/scripts/rehearse_kube.py" "$repo/deploy/k8s" "$work/kube.yaml" --bootstrap "$bootstrap" \
  --prefix "$kprefix" --scans "$work/scans" --claim-check "rehearsal-$id-claim-check"
podman run --rm --network host --env-file "$work/env" -e VLMSTREAM_TOPICS__DOCUMENTS="$kprefix.documents" \
  -e VLMSTREAM_TOPICS__IMAGES="$kprefix.images" -e VLMSTREAM_TOPICS__DESCRIPTIONS="$kprefix.descriptions" \
  -e VLMSTREAM_TOPICS__EMBEDDINGS="$kprefix.embeddings" -e VLMSTREAM_TOPICS__RESULTS="$kprefix.results" \
  -e VLMSTREAM_TOPICS__SUMMARIES="$kprefix.summaries" -e VLMSTREAM_TOPICS__DEADLETTER="$kprefix.deadletter" \
  localhost/vlmstream-decode:latest vlmstream topics create >>"$work/topics.log" 2>&1 || { cat "$work/topics.log" >&2; exit 1; }
podman secret rm vlmstream-secrets >/dev/null 2>&1 || true
podman secret create vlmstream-secrets "$work/kube.secret.json" >/dev/null
podman kube play --network host "$work/kube.yaml" >"$work/kube-play.log" 2>&1 || { cat "$work/kube-play.log" >&2; exit 1; }
say "part 2: podman kube play of deploy/k8s (decode, inference, ConfigMap, Secret)"
containers+=("$kprefix-producer")
podman run -d --name "$kprefix-producer" --network host --env-file "$work/env" -v "$work/scans:/scans:ro" \
  -e VLMSTREAM_TOPICS__DOCUMENTS="$kprefix.documents" -e VLMSTREAM_TOPICS__DEADLETTER="$kprefix.deadletter" \
  localhost/vlmstream-decode:latest vlmstream produce --manifest /scans/manifest-files.jsonl >/dev/null
part2=1
for _ in $(seq 1 90); do
  if check "$kprefix" /scans/plan-k8s.json >"$work/check2.txt" 2>&1; then part2=0; break; fi
  sleep 10
done
cat "$work/check2.txt" >&2

verdict() {  # "images described X of Y, documents with a result N of M" from the checker's report
  python3 - "$1" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
images = re.search(r"images described at least once\s+(\d+) of (\d+)", text)
docs = re.search(r"documents with a complete result\s+(\d+)", text)
planned = re.search(r"documents in \(planned / on the topic\)\s+(\d+)", text)
print(f"images described {images.group(1)} of {images.group(2)}, documents with a result {docs.group(1)} of "
      f"{planned.group(1)}" if images and docs and planned else "no report")
PY
}
say "took $(( $(date +%s) - started ))s"
status=$(( part1 | tap | part2 ))
echo "rehearsal $([ $status = 0 ] && echo PASSED || echo FAILED): containers: $(verdict "$work/check1.txt")," \
  "exported $exported of $docs; kube play: $(verdict "$work/check2.txt")"
exit $status

"""deploy/k8s's ConfigMap, Secret and Deployments as `podman kube play` runs them on one host (scripts/rehearse.sh):
the same files with what only a cluster has swapped for this host's: the local broker (plaintext, so no CA volume
and no SASL), this run's own topic and group names, the scans folder as a host path, the claim-check store a named
volume, and the CPU inference image with the tiny model where the cluster has a GPU and vLLM.

    python scripts/rehearse_kube.py deploy/k8s OUT.yaml --bootstrap HOST:PORT --prefix P --scans DIR --claim-check VOL
"""

from __future__ import annotations

import argparse
import base64
import json
from pathlib import Path

import yaml

METRICS_PORTS = {"decode": 19400, "infer": 19401}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("k8s", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--prefix", required=True)
    ap.add_argument("--scans", required=True)
    ap.add_argument("--claim-check", required=True)
    args = ap.parse_args()
    docs = {}
    for name in ("configmap", "secret", "decode", "infer"):
        (doc,) = [d for d in yaml.safe_load_all((args.k8s / f"{name}.yaml").read_text()) if d]
        docs[name] = doc

    data = docs["configmap"]["data"]
    for key in ("VLMSTREAM_KAFKA__SECURITY_PROTOCOL", "VLMSTREAM_KAFKA__SASL_MECHANISM", "VLMSTREAM_KAFKA__SSL_CAFILE"):
        data.pop(key)
    data["VLMSTREAM_KAFKA__BOOTSTRAP_SERVERS"] = args.bootstrap
    data["VLMSTREAM_TOPICS__PARTITIONS"] = "4"
    data["VLMSTREAM_TOPICS__REPLICATION_FACTOR"] = "1"
    for key, value in list(data.items()):
        if key.startswith("VLMSTREAM_TOPICS__") and value.startswith("vlmstream."):
            data[key] = f"{args.prefix}.{value.removeprefix('vlmstream.')}"
    data["VLMSTREAM_DECODE__GROUP_ID"] = f"{args.prefix}-decode"
    data["VLMSTREAM_INFER__GROUP_ID"] = f"{args.prefix}-infer"
    data["VLMSTREAM_INFER__MODEL"] = "/opt/tiny-model"
    data["VLMSTREAM_INFER__MAX_NEW_TOKENS"] = "8"
    # Set per container below: podman 4.3 lets envFrom override env (Kubernetes does the reverse).
    data.pop("VLMSTREAM_METRICS_PORT")

    # podman 4.3 keeps a Secret given to kube play as YAML but reads a secretKeyRef's podman secret as a JSON object
    # of base64 values: the Secret's keys go to `podman secret create` that way (OUT with suffix .secret.json).
    secret = docs.pop("secret")
    args.out.with_suffix(".secret.json").write_text(json.dumps(
        {k: base64.b64encode(v.encode()).decode() for k, v in secret["stringData"].items()}))

    for name in ("decode", "infer"):
        pod = docs[name]["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        container["volumeMounts"] = [m for m in container["volumeMounts"] if m["name"] not in ("kafka-ca", "shm")]
        pod["volumes"] = [v for v in pod["volumes"] if v["name"] not in ("kafka-ca", "shm")]
        for volume in pod["volumes"]:
            if volume["name"] == "scans":
                volume.clear()
                volume.update({"name": "scans", "hostPath": {"path": args.scans, "type": "Directory"}})
            elif volume["name"] == "claim-check":
                volume["persistentVolumeClaim"]["claimName"] = args.claim_check
            elif volume["name"] == "models":
                volume.clear()
                volume.update({"name": "models", "emptyDir": {}})
        container["resources"] = {"requests": {"cpu": "1", "memory": "1Gi"}}
        # The host's network (where the broker's advertised 127.0.0.1 is): no port mappings, and each pod's metrics
        # endpoint on a port of its own.
        container.pop("ports", None)
        port = METRICS_PORTS[name]
        container["env"].append({"name": "VLMSTREAM_METRICS_PORT", "value": str(port)})
        for probe in ("startupProbe", "readinessProbe"):
            container[probe]["httpGet"]["port"] = port
        container["livenessProbe"]["exec"]["command"][1] = str(port)
        if name == "decode":
            for env in container["env"]:
                if env["name"] == "VLMSTREAM_DECODE__WORKERS":
                    env["value"] = "1"
        else:
            container["image"] = "vlmstream-infer-cpu:latest"
            for env in container["env"]:
                if env["name"] == "VLMSTREAM_INFER__ENGINE":
                    env["value"] = "transformers"
    args.out.write_text(yaml.safe_dump_all([docs[n] for n in ("configmap", "decode", "infer")],
                                           sort_keys=False))


if __name__ == "__main__":
    main()

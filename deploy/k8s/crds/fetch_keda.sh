#!/usr/bin/env bash
# Copies KEDA's CRDs of one version (default v2.21.1) from its Go module into this folder.
set -euo pipefail
version=${1:-v2.21.1}
here=$(cd "$(dirname "$0")" && pwd)
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cd "$scratch"
go mod init scratch >/dev/null 2>&1
# -json prints the zip's path even when the module asks for a newer Go than this one (it is downloaded all the same).
zip=$(GOFLAGS=-mod=mod go mod download -json "github.com/kedacore/keda/v2@$version" | sed -n 's/.*"Zip": "\(.*\)".*/\1/p')
for crd in keda.sh_scaledobjects.yaml keda.sh_triggerauthentications.yaml; do
  unzip -o -j -q "$zip" "github.com/kedacore/keda/v2@$version/config/crd/bases/$crd" -d "$here"
done

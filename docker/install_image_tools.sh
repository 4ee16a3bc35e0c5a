#!/usr/bin/env bash
# What tests/test_image.py needs to build and run the training image without Docker Hub or a Docker
# engine: podman + buildah (build, run) and mmdebstrap (the CPU base; debootstrap is the slower
# fallback). CI (.ci/run) calls this on a fresh machine; where all are installed it does nothing.
# Needs root (CI runs as root).
set -euo pipefail
missing=()
for tool in podman buildah mmdebstrap debootstrap; do
    command -v "${tool}" > /dev/null || missing+=("${tool}")
done
if ((${#missing[@]} == 0)); then
    exit 0
fi
if [[ "$(id -u)" != 0 ]]; then
    echo "install_image_tools.sh: ${missing[*]} missing and not root: the image test will be skipped" >&2
    exit 0
fi
start=${SECONDS}
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends podman buildah mmdebstrap debootstrap > /dev/null
echo "install_image_tools.sh: installed ${missing[*]} in $((SECONDS - start)) s" >&2

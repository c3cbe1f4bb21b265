#!/usr/bin/env bash
# Build loraplex's images with podman (or docker: PODMAN=docker), and print each one's size.
#
#   deploy/images.sh [cpu] [cuda] [redis] [s3]     (default: cpu)
#
# cpu and cuda are the project's images (docker/); redis and s3 stand in for public images where no
# registry is reachable (deploy/podman/: Debian's Redis for the chart's redis:7.4-alpine, and moto's
# S3 server for deploy/local-kube.sh), built on the same base.
#
# The base image: LORAPLEX_BASE_IMAGE names one to build on (python:3.11-slim where a registry is
# reachable). Without it, a Debian base is made here with debootstrap (python3 and its venv, wget
# for KubeRay's probes): localhost/loraplex-base:bookworm, built once and kept.
# Torch: TORCH_WHEELS names a folder holding torch's wheel (mounted read-only at build time and
# preferred: the local +cpu build sorts above PyPI's); without it, the Dockerfiles' default (PyTorch's own index).
# The host's CA bundle (CA_BUNDLE, default /etc/ssl/certs/ca-certificates.crt) is mounted for the
# steps that use the package index, never copied into an image.
# Images: LORAPLEX_IMAGE (default localhost/loraplex) and LORAPLEX_IMAGE-cuda, tagged LORAPLEX_TAG
# (default: the chart's image tag, 0.1.0).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
export CONTAINERS_CONF=${CONTAINERS_CONF:-$ROOT/deploy/podman/containers.conf}
PODMAN=${PODMAN:-podman}
IMAGE=${LORAPLEX_IMAGE:-localhost/loraplex}
TAG=${LORAPLEX_TAG:-0.1.0}
BASE=${LORAPLEX_BASE_IMAGE:-}
DEBIAN_BASE=localhost/loraplex-base:bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
TORCH_WHEELS=${TORCH_WHEELS:-}
KINDS=("$@")
[ ${#KINDS[@]} -eq 0 ] && KINDS=(cpu)

size_of() { "$PODMAN" image inspect --format '{{.Size}}' "$1" | awk '{printf "%.0f MB", $1 / 1e6}'; }

debian_base() {
    if "$PODMAN" image exists "$DEBIAN_BASE"; then
        return
    fi
    local rootfs
    rootfs=$(mktemp -d /tmp/loraplex-rootfs.XXXXXX)
    trap 'rm -rf "$rootfs"' RETURN
    # minbase: apt, dpkg, coreutils, passwd (useradd); python3-venv: Debian's python3 has no pip of its own
    debootstrap --variant=minbase --include=python3,python3-venv,wget,ca-certificates,procps \
        bookworm "$rootfs" "$MIRROR" >/dev/null
    rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb
    tar -C "$rootfs" -c . | "$PODMAN" import --quiet --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' --change 'CMD ["/bin/bash"]' - "$DEBIAN_BASE" >/dev/null
    echo "image: $DEBIAN_BASE $(size_of "$DEBIAN_BASE") (debootstrap bookworm, $MIRROR)"
}

if [ -z "$BASE" ]; then
    debian_base
    BASE=$DEBIAN_BASE
fi

build_args=(--build-arg "BASE_IMAGE=$BASE")
volumes=()
if [ -f "$CA_BUNDLE" ]; then
    volumes+=(-v "$CA_BUNDLE:/run/build/ca.crt:ro")
    build_args+=(--build-arg PIP_CERT=/run/build/ca.crt)
fi
torch_args=()  # the CPU image's torch from a folder of wheels (the CUDA image takes PyPI's CUDA build)
if [ -n "$TORCH_WHEELS" ]; then
    torch_args=(-v "$(cd "$TORCH_WHEELS" && pwd):/run/build/wheels:ro"
                --build-arg "TORCH_SOURCE=--find-links /run/build/wheels")
fi

for kind in "${KINDS[@]}"; do
    case $kind in
        cpu) name=$IMAGE:$TAG; file=docker/Dockerfile.cpu; extra=("${torch_args[@]}") ;;
        cuda) name=$IMAGE-cuda:$TAG; file=docker/Dockerfile.cuda; extra=() ;;
        redis|s3) name=localhost/loraplex-$kind:$TAG; file=deploy/podman/Containerfile.$kind; extra=() ;;
        *) echo "unknown image kind: $kind (cpu, cuda, redis or s3)" >&2; exit 2 ;;
    esac
    start=$(date +%s)
    "$PODMAN" build "${volumes[@]}" "${build_args[@]}" "${extra[@]}" -f "$ROOT/$file" -t "$name" "$ROOT" >/dev/null
    echo "image: $name $(size_of "$name") (from $BASE, built in $(( $(date +%s) - start )) s)"
done

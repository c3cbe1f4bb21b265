#!/usr/bin/env bash
# The chart's pods run in podman as Kubernetes and KubeRay would run them, used as after `helm install`,
# and a worker pod and the head killed under load (deploy/local_kube.py says each step). Needs root,
# podman (with runc), debootstrap and the project's venv (.venv, with the test extras).
#   deploy/local-kube.sh [--skip-build] [--skip-faults] [--port N]
# Prints `image: NAME SIZE` for each image, the figures, and last `N passed, M failed`.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export CONTAINERS_CONF=${CONTAINERS_CONF:-$ROOT/deploy/podman/containers.conf}
PYTHON=${PYTHON:-$ROOT/.venv/bin/python}
args=()
build=1
for arg in "$@"; do
    if [ "$arg" = --skip-build ]; then build=0; else args+=("$arg"); fi
done
if [ $build = 1 ]; then
    # torch's CPU wheel from pip's own folder of wheels when it has one (this machine), else PyTorch's index
    wheels=$("$PYTHON" -m pip config get global.find-links 2>/dev/null || true)
    if [ -n "$wheels" ] && compgen -G "$wheels/torch-*+cpu-*.whl" >/dev/null; then export TORCH_WHEELS=${TORCH_WHEELS:-$wheels}; fi
    "$ROOT/deploy/images.sh" cpu redis s3
else
    for image in localhost/loraplex:0.1.0 localhost/loraplex-redis:0.1.0 localhost/loraplex-s3:0.1.0; do
        echo "image: $image $(podman image inspect --format '{{.Size}}' "$image" | awk '{printf "%.0f MB", $1 / 1e6}') (built before)"
    done
fi
cd "$ROOT"
exec "$PYTHON" -m deploy.local_kube ${args[@]+"${args[@]}"}

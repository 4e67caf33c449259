#!/usr/bin/env bash
# Build the CPU image from deploy/docker/Dockerfile and run it for real:
# deploy/docker/image_check.py then checks what it holds and sends a Generate to
# `specdec up --pair tiny` inside it, and prints one table.
#
#   deploy/docker/test-image.sh           # from a checkout with `.[test]` installed
#
# - Tools: podman, buildah and debootstrap, installed with apt where missing.
# - Base: the Dockerfile's public python:3.11-slim where a registry answers;
#   otherwise a local Debian with Python 3.11 (debootstrap, imported once and
#   kept as localhost/specdec-base:bookworm). SPECDEC_IMAGE_BASE=public|local
#   forces either.
# - torch: the CPU wheel from pip's local wheel directory (find-links) where it
#   lies there, mounted into the build; otherwise torch's CPU index. pip's CA
#   bundle (a proxy's) is mounted too where pip is configured with one.
# - The build is podman's (chroot isolation: no OCI runtime needed), so its layer
#   cache serves the next run on the same machine; the image runs with
#   `buildah run --isolation chroot`, sharing the host's loopback.
#
# Environment: PYTHON (the host's python with specdec; default python),
# SPECDEC_IMAGE (default localhost/specdec:cpu-test).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-python}
IMAGE=${SPECDEC_IMAGE:-localhost/specdec:cpu-test}
LOCAL_BASE=localhost/specdec-base:bookworm
PUBLIC_BASE=docker.io/library/python:3.11-slim
TORCH_VERSION=$(sed -n 's/^ARG TORCH_VERSION=//p' deploy/docker/Dockerfile)
say() { echo "test-image: $*" >&2; }

if ! "$PYTHON" -c "import specdec, helm_python" 2>/dev/null; then
    say "$PYTHON cannot import specdec and helm_python; install the project with its test extra first (see README)"
    exit 2
fi

# --- tools ----------------------------------------------------------------------
missing=()
for tool in podman buildah debootstrap; do command -v "$tool" >/dev/null || missing+=("$tool"); done
if [ ${#missing[@]} -gt 0 ]; then
    say "installing ${missing[*]} with apt"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 \
        || { apt-get update -qq && apt-get install -y -qq "${missing[@]}" >/dev/null; }
fi

# --- base -----------------------------------------------------------------------
base=${SPECDEC_IMAGE_BASE:-}
if [ -z "$base" ]; then
    if podman image exists "$PUBLIC_BASE" || timeout 120 podman pull -q "$PUBLIC_BASE" >/dev/null 2>&1; then
        base=public
    else
        base=local
        say "no registry answers for $PUBLIC_BASE; building on a local Debian base"
    fi
fi
if [ "$base" = public ]; then
    cpu_base=$PUBLIC_BASE
else
    cpu_base=$LOCAL_BASE
    if ! podman image exists "$LOCAL_BASE"; then
        root=$(mktemp -d)
        trap 'rm -rf "$root"' EXIT
        started=$SECONDS
        # Debian 12's python3 is 3.11, as the public base's.
        debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" \
            >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
        rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root.log"
        tar -C "$root" -c . | podman import -q - "$LOCAL_BASE" >/dev/null
        rm -rf "$root"
        say "local base $LOCAL_BASE built in $((SECONDS - started)) s"
    fi
fi

# --- build ----------------------------------------------------------------------
build=(podman build --isolation chroot -f deploy/docker/Dockerfile -t "$IMAGE"
       --build-arg VARIANT=cpu --build-arg CPU_BASE="$cpu_base")
wheels=${PIP_FIND_LINKS:-$("$PYTHON" -m pip config get global.find-links 2>/dev/null || true)}
if [ -n "$wheels" ] && compgen -G "$wheels/torch-$TORCH_VERSION+cpu-*.whl" >/dev/null; then
    # torch's CPU wheel from this directory; its dependencies from PyPI.
    build+=(--volume "$wheels:/wheels:ro" --build-arg PIP_FIND_LINKS=/wheels
            --build-arg TORCH_INDEX_URL=https://pypi.org/simple)
    say "torch $TORCH_VERSION+cpu from $wheels"
fi
cert=${PIP_CERT:-$("$PYTHON" -m pip config get global.cert 2>/dev/null || true)}
if [ -n "$cert" ] && [ -f "$cert" ]; then
    build+=(--volume "$cert:/run/pip-ca.pem:ro" --build-arg PIP_CERT=/run/pip-ca.pem)
fi
say "building $IMAGE on $cpu_base"
started=$SECONDS
if ! "${build[@]}" . >/tmp/specdec-image-build.log 2>&1; then
    tail -40 /tmp/specdec-image-build.log >&2
    say "the build failed (whole log: /tmp/specdec-image-build.log)"
    exit 1
fi
build_s=$((SECONDS - started))
say "built $IMAGE in $build_s s"

# --- what it holds, and the image run ---------------------------------------------
status=0
"$PYTHON" deploy/docker/image_check.py --image "$IMAGE" --build-seconds "$build_s" || status=$?
say "done in $SECONDS s (tools, base, build and checks), exit status $status"
exit $status

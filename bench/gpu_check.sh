#!/usr/bin/env bash
# Validate flatgrad on a GPU node in one command, budgeted at 8 minutes on one H200 (--quick: 4):
# `flatgrad check` (python -m flatgrad.check) on this checkout, so that its build and GPU tests run too.
#
#   bench/gpu_check.sh [--quick] [--out DIR] [--build-dir DIR] [--only STEPS] [--skip STEPS]
#   bench/gpu_check.sh --dry-run      # any machine, no GPU: checks that every step can run; CI runs it
#   bench/gpu_check.sh --fetch-wheels # here, with network: put DeepSpeed and its missing deps in .whl/
#
# Steps, most informative first (flatgrad/check/plan.py's BUDGET table gives each step's timeout, 480 s
# in all): wheels, env, build (C++ and CUDA for the visible GPUs' archs, cached by content in
# --build-dir), backends, kernels (pack/unpack and their plans on cuda and triton, bitwise against the
# reference), zero-offload (ZeRO-2/3 with CPU optimizer offload, stock against flatgrad: losses, peak
# memory), streams (shard-target delivery, deliver() and the two-stage stream order behind sleeps),
# wire (every wire mode on cuda and triton, bitwise), zero-step (ZeRO-2/3 stock against flatgrad on every
# GPU), test-reducer, test-cuda, test-kernels, qgz (qgz_int8/qgz_fp8 and DeepSpeed's ZeRO++ qgZ on simulated
# ranks: error and bytes; stock's only where its quantizer op loads), bench (flatgrad bench --device cuda),
# test-triton. A failure is recorded and the next step runs; the summary is rewritten after each step. Results
# go to --out (default $OUT, else ./gpu-check-out): summary.txt, summary.json, gpu_check.log, bench.json,
# zero_step.json, zero_offload.json, streams.json, qgz.json. Exit status 0 only when every step passed.
# Without a checkout, `flatgrad check` from an installed package runs the same steps but wheels, build
# and the test-* steps.
#
# On this workplace's device machine (tool `run`, kind nvidia-h200; /work/.library/device/README.md).
# Its image has torch, Triton, nvcc, pytest, hypothesis and pytest-timeout but no DeepSpeed, and it
# cannot download, so DeepSpeed travels as wheels in .whl/ (about 5 MB):
#   1. here, once, in the repo root (network needed):
#        echo /.whl/ >> .git/info/exclude      # .gitignore already ignores /.whl/ in this repo
#        bench/gpu_check.sh --fetch-wheels
#      It runs, for the device's Python 3.12:
#        pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#          -d .whl hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
#          typing-inspection==0.4.5 typing-extensions==4.16.0 ninja==1.13.2
#        DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation -w .whl deepspeed==0.19.8   # sdist only on PyPI
#   2. one call: run(command="bench/gpu_check.sh", carry=[".whl"], timeout_s=540)
#      (--dry-run, on any machine, prints the budget table: each step's timeout and their sum)
#      The `wheels` step installs .whl/*.whl with `pip install --no-index --no-deps --target` into
#      BUILD_DIR/site and puts it first on PYTHONPATH (its bin/, with ninja for the build, first on PATH) for
#      the later steps. $OUT's files come back;
#      the summary is also the last thing printed. A warm machine keeps --build-dir (/tmp), so a
#      second call skips the compile; `--only bench,zero-step` reruns a subset.
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's flatgrad, installed or not

if [ "${1:-}" = "--fetch-wheels" ]; then
  set -e
  mkdir -p "$ROOT/.whl"
  "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$ROOT/.whl" hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 typing-extensions==4.16.0 ninja==1.13.2
  DS_BUILD_OPS=0 "$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$ROOT/.whl" deepspeed==0.19.8
  ls -l "$ROOT/.whl"
  exit 0
fi

exec "$PYTHON" -m flatgrad.check --root "$ROOT" "$@"

#!/usr/bin/env bash
# Compile check of the CUDA extension; no GPU needed.
#
# Builds csrc/*.cpp + csrc/cuda/*.cu into flatgrad._C with a CUDA torch
# ($PYTHON, default /work/venv-cuda/bin/python) for TORCH_CUDA_ARCH_LIST
# (default 9.0), in a copy of the sources under a temporary directory, so the
# in-place CPU build in flatgrad/ is never touched. Fails on any compile
# error, then checks that
#   1. the shared object carries an sm_90 cubin with the flatgrad kernels,
#   2. importing it under the CUDA torch registers CUDA (and CPU) kernels for
#      flatgrad::pack, flatgrad::unpack and the plans' _pack_table / _unpack_table,
#   3. the CUDA element loop passes its host-side check
#      (.ci/cuda_copy_host_check.cu, under UBSan so that a misaligned 16-byte
#      vector access fails the check).
# KEEP_BUILD=1 keeps the temporary directory and prints its path.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-/work/venv-cuda/bin/python}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
export MAX_JOBS=${MAX_JOBS:-1}
export FLATGRAD_BUILD_CUDA=1
# torch guesses CUDA_HOME from `which nvcc`; the /usr/local/bin/nvcc wrapper makes
# that /usr/local, which has no lib64/libcudart. Prefer the real toolkit root.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi

WORK=$(mktemp -d /tmp/flatgrad-cuda-build.XXXXXX)
if [ "${KEEP_BUILD:-0}" = "1" ]; then
  echo "build directory kept: $WORK"
else
  trap 'rm -rf "$WORK"' EXIT
fi

step() { printf '\n--- %s\n' "$1"; }

step "toolchain"
"$PYTHON" - <<'EOF'
import torch
from torch.utils.cpp_extension import CUDA_HOME
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, CUDA_HOME {CUDA_HOME}")
if torch.version.cuda is None or CUDA_HOME is None:
    raise SystemExit("a CUDA build of torch and a CUDA toolkit (nvcc) are required")
EOF
CUDA_HOME=$("$PYTHON" -c 'from torch.utils.cpp_extension import CUDA_HOME; print(CUDA_HOME)')
TORCH_INCLUDE=$("$PYTHON" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "include"))')

step "copy sources to $WORK/src"
mkdir -p "$WORK/src"
(cd "$ROOT" && tar --exclude='*.so' --exclude='__pycache__' -cf - setup.py pyproject.toml README.md csrc flatgrad 2>/dev/null || true) \
  | tar -xf - -C "$WORK/src"
ls "$WORK/src"/csrc/*.cpp "$WORK/src"/csrc/cuda/*.cu

step "build flatgrad._C (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)"
start=$(date +%s)
(cd "$WORK/src" && "$PYTHON" setup.py -q build_ext --build-lib "$WORK/lib" --build-temp "$WORK/temp")
echo "compile time: $(($(date +%s) - start)) s"
SO=$(ls "$WORK"/lib/flatgrad/_C*.so 2>/dev/null | head -n 1 || true)
[ -n "$SO" ] || { echo "no flatgrad/_C*.so was built (is there a csrc/*.cpp?)"; exit 1; }
echo "built: $SO ($(du -h "$SO" | cut -f1))"

step "sm_90 cubin and kernels in the shared object"
CUOBJDUMP=""
for candidate in "$CUDA_HOME/bin/cuobjdump" "$(command -v cuobjdump || true)" \
  "$("$PYTHON" -c 'import os, triton; print(os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump"))' 2>/dev/null || true)"; do
  if [ -n "$candidate" ] && [ -x "$candidate" ]; then CUOBJDUMP=$candidate; break; fi
done
[ -n "$CUOBJDUMP" ] || { echo "cuobjdump not found (CUDA_HOME/bin, PATH, triton's bundle)"; exit 1; }
ELF=$("$CUOBJDUMP" --list-elf "$SO")
echo "$ELF"
for arch in $(echo "$TORCH_CUDA_ARCH_LIST" | tr ';' ' ' | sed 's/+PTX//g; s/\.//g'); do
  echo "$ELF" | grep -q "sm_$arch" || { echo "no sm_$arch cubin in $SO"; exit 1; }
done
# Kernel names in the cubin, demangled, without the anonymous namespace.
KERNELS=$("$CUOBJDUMP" --dump-elf-symbols "$SO" | grep -o '_Z[A-Za-z0-9_]*' | c++filt \
  | grep -Eo '(unpack_kernel|pack_kernel)<[^(]*>|stats_finish_kernel' | sort -u)
echo "$KERNELS" | sed 's/^/  /'
for kernel in '^pack_kernel<' '^unpack_kernel<' '^stats_finish_kernel$'; do
  echo "$KERNELS" | grep -q "$kernel" || { echo "no ${kernel//[\^<$]/} in the cubin"; exit 1; }
done
WIRE=$("$CUOBJDUMP" --dump-elf-symbols "$SO" | grep -o '_Z[A-Za-z0-9_]*' | c++filt \
  | grep -Eo '(dequantize_sum_kernel|quantize_kernel|sum_kernel)<[^(]*>|pack_quantize_kernel|requantize_kernel' | sort -u)
for kernel in '^sum_kernel<' '^quantize_kernel<' '^dequantize_sum_kernel<' '^pack_quantize_kernel$' '^requantize_kernel$'; do
  echo "$WIRE" | grep -q "$kernel" || { echo "no ${kernel//[\^<]/} (wire kernels) in the cubin"; exit 1; }
done
echo "wire kernels: $(echo "$WIRE" | wc -l) instances"
echo "pack_kernel: $(echo "$KERNELS" | grep -c '^pack_kernel<') instances, unpack_kernel: $(echo "$KERNELS" | grep -c '^unpack_kernel<') instances"
echo "resource usage (registers, spills):"
"$CUOBJDUMP" --dump-resource-usage "$SO" | grep -o 'REG:[0-9]* STACK:[0-9]* SHARED:[0-9]* LOCAL:[0-9]*' | sort | uniq -c | sed 's/^/  /'

step "import under the CUDA torch: registered kernels"
cp "$SO" "$WORK/src/flatgrad/"
(cd "$WORK" && PYTHONPATH="$WORK/src" "$PYTHON" - <<'EOF'
import torch
import flatgrad._C  # noqa: F401  (registers torch.ops.flatgrad)

has = torch._C._dispatch_has_kernel_for_dispatch_key
ops = ("pack", "unpack", "_pack_table", "_unpack_table", "wire_sum", "wire_quantize", "wire_dequantize_sum",
       "_pack_quantize_table", "wire_requantize")
for op in ops:
    print(" ", getattr(torch.ops.flatgrad, op).default._schema)
missing = [f"flatgrad::{op} {key}" for op in ops for key in ("CUDA", "CPU") if not has(f"flatgrad::{op}", key)]
if missing:
    raise SystemExit(f"no kernel registered for: {missing}")
print(f"CUDA and CPU kernels are registered for {', '.join('flatgrad::' + op for op in ops)}")
EOF
)

step "host-side check of the CUDA element loop (UBSan)"
"$CUDA_HOME/bin/nvcc" -std=c++20 -O1 --fmad=false \
  -Xcompiler -fsanitize=undefined -Xcompiler -fsanitize=alignment -Xcompiler -fno-sanitize-recover=all -lubsan \
  -I "$ROOT/csrc/include" -I "$TORCH_INCLUDE" -o "$WORK/cuda_copy_host_check" "$ROOT/.ci/cuda_copy_host_check.cu"
"$WORK/cuda_copy_host_check"

step "CUDA build check passed"

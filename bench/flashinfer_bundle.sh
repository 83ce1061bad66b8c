#!/usr/bin/env bash
# Pack FlashInfer for a GPU host that has PyTorch and nvcc but no FlashInfer and no package index
# (README, "CUDA path"). Run here, in the repository root, where PyPI is reachable:
#
#     bash bench/flashinfer_bundle.sh        # -> .whl/flashinfer-<v>-site.tar.xz, .whl/apache_tvm_ffi-*.whl
#
# The flashinfer-python wheel (62.2 MiB) plus apache-tvm-ffi is over the 64 MiB a device call
# carries; the same files installed with `pip install --target` and packed with xz are ~16 MiB.
# Nothing is built: the kernels are JIT-compiled on the GPU host by its nvcc.
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-.whl}
FI_VERSION=${FI_VERSION:-0.7.2}          # the version SGLang 0.5.23 pins
TVM_FFI_VERSION=${TVM_FFI_VERSION:-0.1.11}
HOST_PYTHON=${HOST_PYTHON:-3.12}         # the GPU host's python3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$OUT"
if [ "$OUT" = .whl ]; then  # keep the bundle out of git (it travels with `carry`)
    exclude=$(git rev-parse --git-path info/exclude)
    grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
fi
"$PY" -m pip download -q --no-deps -d "$tmp" "flashinfer-python==$FI_VERSION"
"$PY" -m pip install -q --no-deps --no-compile --target "$tmp/site" "$tmp"/flashinfer_python-*.whl
tar -C "$tmp/site" -cJf "$OUT/flashinfer-$FI_VERSION-site.tar.xz" .
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$HOST_PYTHON" --implementation cp \
    --platform manylinux_2_28_x86_64 -d "$OUT" "apache-tvm-ffi==$TVM_FFI_VERSION"
ls -l "$OUT"

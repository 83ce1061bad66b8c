#!/usr/bin/env bash
# On the GPU host (PyTorch, nvcc, no SGLang, no FlashInfer, no index), from the repository root with
# .whl/ made by bench/flashinfer_bundle.sh: unpack FlashInfer into $SITE, run the CUDA tests, then
# bench.gpu_check (its arguments are passed on). Exit code: the check's, or the tests' if they fail.
set -uo pipefail
SITE=${SITE:-/tmp/site}
mkdir -p "$SITE"
tar -C "$SITE" -xJf .whl/flashinfer-*-site.tar.xz || exit 2
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
    .whl/apache_tvm_ffi-*.whl || exit 2
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -m bench.gpu_check "$@"
check=$?
python3 -m pytest -q -p no:cacheprovider tests/test_flashinfer_indices.py tests/test_transfer_schedule_cuda.py \
    tests/test_sparse_decode.py
tests=$?
[ "$tests" -ne 0 ] && exit "$tests"
exit "$check"

#!/usr/bin/env bash
# GPU check: the kernel tests compiled for the GPU (no TRITON_INTERPRET), then bench/kernel_ops.py; one table.
#
#   bash bench/gpu_check.sh            # from the repository root, on a machine with CUDA and triton
#   PYTHON=python3 bash bench/gpu_check.sh
#
# Exit status: non-zero when a test fails (the benchmark still runs and its table still prints).
set -uo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
unset TRITON_INTERPRET
export HF_HUB_OFFLINE=1

if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu-check: no CUDA device visible to $PYTHON" >&2
    exit 2
fi
if ! "$PYTHON" -c "import triton" 2>/dev/null; then
    echo "gpu-check: triton is not installed for $PYTHON (pip install 'triton>=3.0')" >&2
    exit 2
fi

mkdir -p bench/results
log=bench/results/gpu_check_tests.log
started=$SECONDS
"$PYTHON" -m pytest tests/kernels -rfE -p no:cacheprovider >"$log" 2>&1
tests_status=$?
test_seconds=$((SECONDS - started))

bench_output=$("$PYTHON" bench/kernel_ops.py 2>&1)   # writes bench/results/kernels_<GPU kind>.json
bench_status=$?

summary=$(grep -E "passed|failed|error" "$log" | tail -n 1)
versions=$("$PYTHON" -c 'import torch, triton
print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")')
echo "== gpu-check: $versions"
echo "== kernel tests (native, tests/kernels): ${summary:-no summary, see $log} in ${test_seconds}s"
if [[ $tests_status -ne 0 ]]; then
    grep -E "^(FAILED|ERROR)" "$log" | sed 's/^/   /'
fi
echo "$bench_output"
if [[ $bench_status -ne 0 ]]; then
    echo "gpu-check: bench/kernel_ops.py failed (status $bench_status)" >&2
fi
exit $((tests_status != 0 || bench_status != 0))

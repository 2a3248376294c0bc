#!/usr/bin/env bash
# The GPU suite on the device machine (two H200s): installs the carried test wheels (.whl: pytest,
# psutil and their needs), then runs `pytest -m gpu` in its own session, so that a later call can
# wait for it and collect the log and the figures (GPU_REPORT) from /tmp/gpu-suite.
#   GPU_SUITE_COMMIT=abc1234 bash bench/gpu-suite.sh start [PYTEST_ARGS...]   # then: ... wait SECONDS
set -uo pipefail
LOG=/tmp/gpu-suite
case ${1:-start} in
  start)
    shift || true
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    rm -rf "$LOG" && mkdir -p "$LOG"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$LOG/machine.txt"
    # the device's copy of the tree has no history of its own: the caller names the commit
    echo "commit ${GPU_SUITE_COMMIT:-unknown}" >> "$LOG/machine.txt"
    # the machine's own pytest plugins (pytest-timeout ...) may need another pytest than the carried one
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 GPU_REPORT=$LOG/report.jsonl PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    # shellcheck disable=SC2016  # expanded by the inner shell
    setsid bash -c 'python3 -m pytest -m gpu tests/test_gpu.py -v -rA -p no:cacheprovider "$@" > "$0/pytest.log" 2>&1; echo $? > "$0/rc"' "$LOG" "$@" &
    ;;
  wait)
    end=$((SECONDS + ${2:-500}))
    while [ ! -f "$LOG/rc" ] && [ $SECONDS -lt $end ]; do sleep 5; done
    ;;
esac
if [ -n "${OUT:-}" ] && [ -d "$LOG" ]; then cp "$LOG"/* "$OUT"/ 2>/dev/null; fi
grep -E "PASSED|FAILED|ERROR|GPU-REPORT|passed|failed" "$LOG/pytest.log" 2>/dev/null | tail -40

#!/usr/bin/env bash
# The GPU suite on a GPU host (one or two GPUs) without the repository's venv: installs the test
# wheels in .whl/ if there are any (pytest, psutil and their needs, for a host without network), then runs
# `pytest -m gpu` in its own session, so that a later command can wait for it and collect the log
# and the figures (GPU_REPORT) from /tmp/gpu-suite.
#   GPU_SUITE_COMMIT=abc1234 bash bench/gpu-suite.sh start [PYTEST_ARGS...]   # then: ... wait SECONDS
# GPU_SUITE_PARALLEL=N: the correctness cases (resume matrix, streamed decode, pretrained start, gathered
# factors) first, N side by side on the GPU (pytest-xdist, from .whl/), then the cases that time a
# recovery, alone; the pytest arguments go to both.
set -uo pipefail
LOG=/tmp/gpu-suite
case ${1:-start} in
  start)
    shift || true
    if compgen -G '.whl/*.whl' > /dev/null; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    fi
    rm -rf "$LOG" && mkdir -p "$LOG"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$LOG/machine.txt"
    # a copy of the tree may have no git history: GPU_SUITE_COMMIT names the commit (else git says it)
    echo "commit ${GPU_SUITE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" >> "$LOG/machine.txt"
    # the host's own pytest plugins (pytest-timeout ...) may need another pytest than the one in .whl/
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 GPU_REPORT=$LOG/report.jsonl PYTEST_DISABLE_PLUGIN_AUTOLOAD=1
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    if [ -n "${GPU_SUITE_PARALLEL:-}" ]; then
      correct="resume_is_exact or streamed or pretrained or linear_gradients"
      # shellcheck disable=SC2016  # expanded by the inner shell
      setsid bash -c 'n=$1 k=$2; shift 2
        python3 -m pytest -p xdist -n "$n" -m gpu tests/test_gpu.py -v -rA -p no:cacheprovider -k "$k" "$@" > "$0/pytest-side-by-side.log" 2>&1; a=$?
        python3 -m pytest -m gpu tests/test_gpu.py -v -rA -p no:cacheprovider -k "not ($k)" "$@" > "$0/pytest.log" 2>&1; b=$?
        echo $((a > b ? a : b)) > "$0/rc"' "$LOG" "$GPU_SUITE_PARALLEL" "$correct" "$@" &
    else
      # shellcheck disable=SC2016  # expanded by the inner shell
      setsid bash -c 'python3 -m pytest -m gpu tests/test_gpu.py -v -rA -p no:cacheprovider "$@" > "$0/pytest.log" 2>&1; echo $? > "$0/rc"' "$LOG" "$@" &
    fi
    ;;
  wait)
    end=$((SECONDS + ${2:-500}))
    while [ ! -f "$LOG/rc" ] && [ $SECONDS -lt $end ]; do sleep 5; done
    ;;
esac
if [ -n "${OUT:-}" ] && [ -d "$LOG" ]; then cp "$LOG"/* "$OUT"/ 2>/dev/null; fi
cat "$LOG"/pytest-side-by-side.log "$LOG/pytest.log" 2>/dev/null | grep -E "PASSED|FAILED|ERROR|GPU-REPORT|passed|failed" | tail -40
sed -n '/= GPU suite =/,/^=/p' "$LOG"/pytest-side-by-side.log "$LOG/pytest.log" 2>/dev/null | grep -v "^=" | tail -40

#!/usr/bin/env bash
# On a GPU host (one or two GPUs), in one go: strategy checks, benchmark suites, the two-"node" run.
#   bash bench/device.sh strategies bench:micro,article bench:seednet bench:stall,recipes multinode
# Needs the CIFAR-10 JPEG tarballs (train/ and test/ class folders) in .devdata/ and writes to $OUT (default /tmp/out).
# BENCH_ARGS adds options to every `trainer bench` (e.g. "--seeds 4,5,6"); BENCH_CACHE shares the
# decoded data between benches run side by side (CUDA_VISIBLE_DEVICES=0 ... & CUDA_VISIBLE_DEVICES=1 ...).
set -uo pipefail
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
DATA=${DATA:-.devdata}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/machine.txt"
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())' | tee -a "$OUT/machine.txt"

real=(--config configs/default.yaml data.name=imagefolder "data.dir=$DATA" data.cache_dir=/dev/shm/cache train.epochs=1
      train.max_steps=40 train.log_every=10 train.plot=false)
run_py() { python3 -m trainer "$@"; }
run_tr() { python3 -m torch.distributed.run --standalone --nproc-per-node=2 -m trainer "$@"; }

for part in "$@"; do
  case $part in
    strategies)
      {
        echo "### single"; run_py train "${real[@]}" train.strategy=single checkpoint.dir=/dev/shm/s-single
        echo "### dp"; run_py train "${real[@]}" train.strategy=dp checkpoint.dir=/dev/shm/s-dp
        echo "### ddp"; run_tr train "${real[@]}" train.strategy=ddp checkpoint.dir=/dev/shm/s-ddp
        echo "### fsdp"; run_tr train "${real[@]}" train.strategy=fsdp checkpoint.dir=/dev/shm/s-fsdp
        echo "### eval"; run_py eval /dev/shm/s-ddp/step-40 "data.dir=$DATA" data.cache_dir=/dev/shm/cache
      } 2>&1 | grep -vE "^W[0-9]{4}|UserWarning|warnings.warn" | tee "$OUT/strategies.log"
      ;;
    bench:*)   # bench:SUITE[,SUITE...] -> trainer bench --suite SUITES
      suite=${part#bench:}
      name=${suite//,/-}
      # shellcheck disable=SC2086  # BENCH_ARGS: extra options, split on purpose (e.g. "--seeds 4,5,6")
      python3 -m trainer bench --suite "$suite" --data "$DATA" --out "$OUT/$name" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/$name.txt"
      # the table, and one archive of the rest: few files to copy off the host
      tar -czf "$OUT/$name.tgz" -C "$OUT" "$name" && rm -rf "${OUT:?}/$name"
      ;;
    multinode)
      {
        for round in 1 2; do
          echo "### two torchrun nodes, round $round (train.max_steps=$((40 * round)))"
          for node in 0 1; do   # one GPU per "node", as two hosts would have
            CUDA_VISIBLE_DEVICES=$node python3 -m torch.distributed.run --nnodes=2 --nproc-per-node=1 --rdzv-backend=c10d --rdzv-endpoint=127.0.0.1:29611 \
              --rdzv-id=twonode --local-addr=127.0.0.1 -m trainer train "${real[@]}" "train.max_steps=$((40 * round))" \
              checkpoint.dir=/dev/shm/twonode &
          done
          wait
        done
      } 2>&1 | grep -vE "^W[0-9]{4}|UserWarning|warnings.warn" | tee "$OUT/multinode.log"
      ;;
    decode:*)   # decode:SET (photo or large): GPU decode against the CPU workers at 4 and 16 host cores (issue 62)
      kind=${part#decode:}
      {
        [ "$kind" = photo ] && python3 -m bench.data --decode "$DATA"
        n=12800; [ "$kind" = large ] && n=6400
        # the set and its shards, made once with every core
        python3 -m bench.data "$OUT/decode" --cifar "$DATA" --photo "$kind" --images "$n" --cases none > /dev/null
        # all cores first: the model compiles there once, and the later runs find its kernels in the cache
        for run in ${DECODE_RUNS:-0-15:cpu 0-15:nvimgcodec 0-3:cpu 0-3:nvjpeg 0-3:nvimgcodec 0-3:roi}; do
          cores=${run%%:*} dec=${run#*:}
          case=ours-shards-gpu-decode; [ "$dec" = cpu ] && case=ours-shards-cpu-decode
          [ "$kind $run" = "photo 0-15:cpu" ] && case=$case,ceiling-synthetic-on-gpu
          echo "### $kind cores $cores decode $dec"
          TRAINER_GPU_DECODER=$dec taskset -c "$cores" python3 -m bench.data "$OUT/decode" --cifar "$DATA" \
            --photo "$kind" --images "$n" --cases "$case" |
            sed "s/^{/{\"set\": \"$kind\", \"cores\": \"$cores\", \"decoder\": \"$dec\", /"
        done
      } 2>&1 | grep -vE "^W[0-9]{4}|UserWarning|warnings.warn" | tee "$OUT/decode-$kind.log"
      ;;
  esac
done

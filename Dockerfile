# The trainer in a CUDA image. One process per visible GPU through torchrun:
#   docker build -t cluster-trainer:0.1.0 .
#   docker run --gpus all --shm-size 8g -v "$PWD/data:/data:ro" -v "$PWD/checkpoints:/checkpoints" \
#       cluster-trainer:0.1.0 train.epochs=30          # arguments are trainer overrides
# The base pins PyTorch 2.9.0 with CUDA 12.8 and cuDNN 9 (torchvision 0.24.0 matches it).
FROM pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NPROC_PER_NODE=auto \
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
    MAX_RESTARTS=3

WORKDIR /app
COPY pyproject.toml README.md ./
COPY trainer ./trainer
COPY configs ./configs
# The torch pin keeps pip from replacing the image's CUDA build.
RUN pip install "torch==2.9.0" "torchvision==0.24.0" . \
    && useradd --create-home --uid 1000 --user-group trainer \
    && mkdir -p /data /checkpoints \
    && chown trainer:trainer /data /checkpoints

USER 1000:1000
VOLUME ["/data", "/checkpoints"]
# `trainer launch` (PID 1) checks the input (exit 2 on a usage error), then runs torchrun with one
# process per GPU and --max-restarts; `docker stop`'s SIGTERM goes on to torchrun and its workers,
# which save, and the container exits 75 (0 finished, 2 bad input, else a crash).
ENTRYPOINT ["trainer", "launch", "--config", "configs/default.yaml", "data.dir=/data", "checkpoint.dir=/checkpoints"]
CMD []

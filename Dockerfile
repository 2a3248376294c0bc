# The trainer in a CUDA image. One process per visible GPU through torchrun:
#   docker build -t cluster-trainer:0.1.0 .
#   mkdir -p data checkpoints      # made by you, so they are yours (the engine would make them root's)
#   docker run --gpus all --shm-size 8g -u "$(id -u):$(id -g)" -v "$PWD/data:/data" \
#       -v "$PWD/checkpoints:/checkpoints" cluster-trainer:0.1.0 train.epochs=30   # arguments are overrides
# One torch everywhere: pip installs the pins CI tests (constraints.txt: torch 2.14.1, the CUDA 13
# build on PyPI, with its CUDA libraries as wheels; the host needs only the NVIDIA driver).
FROM python:3.11-slim-bookworm

# TORCH_HOME: pretrained weights (model.weights) are cached in the checkpoint volume, which every
# node of a job sees, is writable and outlives the job: downloaded once, or put there by hand offline.
# HOME is writable by any uid (a `user:` override or OpenShift's random uid has no passwd entry and
# no home); trainer.launch.supervisor also points the compile caches somewhere writable when HOME is not.
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/home/trainer \
    NPROC_PER_NODE=auto \
    MAX_RESTARTS=3 \
    TORCH_HOME=/checkpoints/.torch

WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY trainer ./trainer
COPY configs ./configs
# Bytecode compiled here, at build time, also for what the base brought: the container's user
# cannot write site-packages, and without .pyc files every start compiles torch's Python sources
# again (8 s of a restart's worker on an H200 node; BENCHMARKS.md). A file that does not compile
# for this Python (a template, a test of another version) is never imported: its status is not
# the build's.
# The etcd extra: python-etcd, for torchrun's etcd-v2 rendezvous (k8s/elastic-etcd, RDZV_ENDPOINT).
# The export extra: onnx, onnxscript, onnxruntime and safetensors, for trainer export and predict.
RUN python -m pip install -c constraints.txt ".[etcd,export]" \
    && python -c "import compileall, site; [compileall.compile_dir(d, quiet=2, workers=0) for d in site.getsitepackages()]" \
    && useradd --create-home --home-dir /home/trainer --uid 10001 --user-group trainer \
    && chmod 1777 /home/trainer \
    && mkdir -p /data /checkpoints \
    && chown trainer:trainer /data /checkpoints

# a high uid: no clash with a host's users (the Kubernetes manifests run as the same)
USER 10001:10001
VOLUME ["/data", "/checkpoints"]
# No HEALTHCHECK: a batch job serves nothing to probe, and its hang watchdog already ends a run that
# stops making progress with a crash code (Kubernetes ignores HEALTHCHECK anyway)
# checkov:skip=CKV_DOCKER_2:a batch job with its own hang watchdog; nothing for a HEALTHCHECK to probe
# `trainer launch` (PID 1) checks the input (exit 2 on a usage error), then runs torchrun with one
# process per GPU and --max-restarts; `docker stop`'s SIGTERM goes on to torchrun and its workers,
# which save, and the container exits 75 (0 finished, 2 bad input, else a crash).
ENTRYPOINT ["trainer", "launch", "--config", "configs/default.yaml", "data.dir=/data", "checkpoint.dir=/checkpoints"]
CMD []

# Thin aliases around the one entry point (`python -m trainer`). Variables:
#   CONFIG=configs/default.yaml  DATA=<folder of train/ test/ or their .tar.gz>  ARGS="key=value ..."
#   NPROC=auto (one per GPU, else 2)  IMAGE=cluster-trainer:0.1.0  GPUS=8  NODES=2  K8S=multi-node
#   STORAGE_CLASS (k8s-storage)  ENGINE=docker (or podman)  COMPOSE="docker compose" (or docker-compose, podman-compose)  CHECKPOINTS=checkpoints
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONFIG ?= configs/default.yaml
DATA ?=
ARGS ?=
NPROC ?= auto
IMAGE ?= cluster-trainer:0.1.0
GPUS ?= 8
NODES ?= 2
K8S ?= multi-node
ENGINE ?= docker
COMPOSE ?= docker compose
CHECKPOINTS ?= checkpoints
BUILD ?= --build
DATA_ARGS := $(if $(DATA),data.name=imagefolder data.dir=$(DATA))

.PHONY: venv run-local test test-slow test-all test-gpu container-test lint bench image compose-up k8s-storage k8s-apply slurm-submit torchx-k8s slurm-up clean

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,launchers]"
	touch $@

venv: $(BIN)/.installed

## Train here: torchrun with one process per visible GPU (or 2 CPU processes), checkpoints in ./checkpoints
run-local: venv
	$(BIN)/trainer launch --nproc-per-node $(NPROC) --config $(CONFIG) $(DATA_ARGS) $(ARGS)

## The fast suite (minutes); test-slow: multi-process, faults, Slurm, TorchX; test-all: both;
## test-gpu: the GPU suite (resume matrix and faults on CUDA; two GPUs, data in GPU_DATA=.devdata)
test: venv
	$(BIN)/python -m pytest -q -m "not slow and not gpu and not container"

test-slow: venv
	$(BIN)/python -m pytest -q -m "slow and not gpu and not container"

test-all: venv
	$(BIN)/python -m pytest -q -m "not gpu"

test-gpu: venv
	$(BIN)/python -m pytest -q -m gpu tests/test_gpu.py

.venv-compose-v1/bin/docker-compose:
	$(PYTHON) -m venv .venv-compose-v1
	echo 'cython<3' > .venv-compose-v1/build-constraints.txt
	PIP_CONSTRAINT=$(CURDIR)/.venv-compose-v1/build-constraints.txt .venv-compose-v1/bin/pip install -q docker-compose==1.29.2 \
		docker==6.1.3 requests==2.31.0

lint: venv
	$(BIN)/ruff check trainer tests k8s
	$(BIN)/hadolint Dockerfile
	$(BIN)/shellcheck -x slurm/*.sh tests/slurm/*.sh tests/container/*.sh bench/*.sh .ci/run

## GPU benchmark: the article's loop beside this trainer (run it on a GPU machine)
bench: venv
	$(BIN)/trainer bench $(ARGS)

image:
	$(ENGINE) build -t $(IMAGE) .

## docker compose up with ./data (or DATA=folder of the CIFAR-10 tarballs or class folders) and
## CHECKPOINTS made first as you (an engine makes missing ones root's), the containers run as you;
## BUILD= uses IMAGE as it is
compose-up:
	mkdir -p $(or $(DATA),data) $(CHECKPOINTS)
	IMAGE=$(IMAGE) NPROC_PER_NODE=$(NPROC) CONFIG=$(CONFIG) CHECKPOINTS=$(CHECKPOINTS) \
		USER_ID=$${USER_ID:-$$(id -u)} GROUP_ID=$${GROUP_ID:-$$(id -g)} \
		$(if $(DATA),DATA=$(DATA) DATA_NAME=imagefolder) $(COMPOSE) up $(BUILD)

## The image built and run by a real engine (podman here and in CI; the base built locally)
## (podman-compose and docker-compose 1.29.2, the v1 client, through podman's Docker API, run
## docker-compose.yml; v1 in its own venv: its PyYAML<6 clashes with ours and needs Cython<3 to
## build, and it needs the docker-py and requests of its day)
container-test: venv .venv-compose-v1/bin/docker-compose
	$(BIN)/python -m pip install -q podman-compose==1.6.0
	CONTAINERS_CONF=$(CURDIR)/tests/container/containers.conf bash tests/container/base.sh
	$(BIN)/python -m pytest -q -m container tests/test_container.py

## The PVCs, once, apart from the jobs (deleting a job keeps them); STORAGE_CLASS: a ReadWriteMany class
k8s-storage: venv
	manifest=$$(kubectl kustomize k8s/storage | $(BIN)/python k8s/render.py $(if $(STORAGE_CLASS),--storage-class $(STORAGE_CLASS))) \
		&& echo "$$manifest" | kubectl apply -f -

# IMAGE must be pushed (REGISTRY/NAME:TAG); K8S=single-gpu takes neither NODES nor GPUS. A bad
# input stops before kubectl apply (render.py: one line, exit 2).
k8s-apply: venv
	manifest=$$(kubectl kustomize k8s/$(K8S) | $(BIN)/python k8s/render.py --image $(IMAGE) $(if $(filter single-gpu,$(K8S)),,--nodes $(NODES) --gpus $(GPUS))) \
		&& echo "$$manifest" | kubectl apply -f -

slurm-submit:
	CONFIG=$(CONFIG) sbatch --nodes=$(NODES) --gpus-per-node=$(GPUS) slurm/ddp.sh $(ARGS)

torchx-k8s: venv
	$(BIN)/torchx run --workspace "" -s kubernetes trainer/components.py:train_ddp --image $(IMAGE) \
		--j $(NODES)x$(GPUS) --gpu $(GPUS) --config $(CONFIG) --checkpoint_mount cifar-checkpoints --data_mount cifar-data -- $(ARGS)

## Start a one-node Slurm cluster here (root; Debian's slurm-wlm and munge)
slurm-up:
	bash tests/slurm/start-cluster.sh

clean:
	rm -rf .pytest_cache .ruff_cache build *.egg-info

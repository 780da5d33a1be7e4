# make run  : set up .venv (first time only) and train MNIST on 4 ranks, ring mode.
# make test : set up .venv, then serial tests and the MPI tests at 2, 3 and 4 ranks.
# make bench: allreduce and training benchmarks.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
MPIRUN := $(VENV)/bin/mpirun
NP     ?= 4
ARGS   ?=
# An MPI test that hangs is a bug: kill it rather than CI.
MPI_TEST_TIMEOUT ?= 900

.PHONY: run test test-serial test-mpi bench clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[mpich,test]'
	touch $@

run: $(VENV)/.installed
	$(MPIRUN) -n $(NP) $(PY) -m hpctrain.mnist $(ARGS)

test: test-serial test-mpi

test-serial: $(VENV)/.installed
	$(PY) -m pytest -q tests

test-mpi: $(VENV)/.installed
	@set -e; for n in 2 3 4; do \
	  echo "== MPI tests at $$n ranks"; \
	  timeout $(MPI_TEST_TIMEOUT) $(MPIRUN) -n $$n $(PY) -m mpi4py -m pytest -q -p no:cacheprovider --only-mpi tests; \
	done

bench: $(VENV)/.installed
	$(PY) -m hpctrain.bench allreduce
	$(PY) -m hpctrain.bench train --mode ring --ranks 1,2,4

clean:
	rm -rf $(VENV) data/mnist .pytest_cache

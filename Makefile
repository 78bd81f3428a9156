# Two commands for a fresh machine:
#   make demo   set up, then prepare, inspect and verify a dataset on an embedded LocalCluster,
#               feed a model from it through the pipeline, train it from the shell with a run
#               report (`dasktrain train`), and compare every update mode in one figure
#   make test   set up, then run the test suite
#
# The install puts a CPU build of torch in place first, so the project's `torch>=` range is
# already met and pip fetches no multi-GB CUDA build. GPU users override TORCH_INDEX, e.g.
#   make setup TORCH_INDEX=https://download.pytorch.org/whl/cu128

PYTHON ?= python3
VENV ?= .venv
TORCH_VERSION ?= 2.13.0
# Where the CPU build comes from. A local wheel directory (PIP_FIND_LINKS) wins when it
# holds the build; otherwise PyTorch's CPU index is used.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
PY := $(VENV)/bin/python
STAMP := $(VENV)/.dasktrain-installed
DEMO_DIR ?= data
RUNS_DIR ?= runs
# The suite runs in this many pytest processes, each test file whole in one of them (a
# module's fixtures, such as its cluster or its hosts, are made once). 0: this process alone.
TEST_PROCESSES ?= 2

.PHONY: setup demo test lint docs bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	@if $(PY) -c "import torch" 2>/dev/null; then \
	  echo "torch already installed: $$($(PY) -c 'import torch; print(torch.__version__)')"; \
	elif ls $${PIP_FIND_LINKS:-/nonexistent}/torch-$(TORCH_VERSION)* >/dev/null 2>&1; then \
	  $(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"; \
	else \
	  $(PY) -m pip install --quiet "torch==$(TORCH_VERSION)" --index-url $(TORCH_INDEX); \
	fi
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $(STAMP)

demo: setup
	$(VENV)/bin/dasktrain prepare digits $(DEMO_DIR)/digits.zarr --split train=0.8,val=0.2 --normalize --overwrite
	$(VENV)/bin/dasktrain info $(DEMO_DIR)/digits.zarr
	$(VENV)/bin/dasktrain verify $(DEMO_DIR)/digits.zarr
	$(PY) examples/pipeline_digits.py $(DEMO_DIR)/digits.zarr
	$(VENV)/bin/dasktrain train examples/digits.toml --run-dir $(RUNS_DIR)/digits-$$(date +%Y%m%d-%H%M%S)
	$(PY) examples/digits.py $(DEMO_DIR)/digits.zarr --out $(RUNS_DIR)/modes

test: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -n $(TEST_PROCESSES) --dist loadfile

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# The documentation site (docs/, API reference from the docstrings) into site/.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The pipeline, holder, update-throughput, scaling, straggler, end-to-end, image and text
# benchmarks, then one table of their ratios (their own reports on stderr); preparation has
# its own table.
bench: setup
	$(VENV)/bin/dasktrain bench
	$(PY) benchmarks/prepare.py

clean:
	rm -rf $(VENV) build dist site *.egg-info

# Two commands do everything on a fresh machine: `make train` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install train test lint bench docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# CPU build of torch from local disk on dev/CI machines; an unpinned torch would pull a CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,hf,data]'
	touch $(STAMP)

install: $(STAMP)

train: $(STAMP)
	$(BIN)/python examples/train.py $(ARGS)

# JOBS test processes (pytest-xdist), one test file each at a time so module fixtures run once, the longest files
# first (tests/conftest.py); JOBS=0: serial.
# SLOW=1 adds the tests marked slow (the wider matrix of launchers, signals, ranks and layouts), as CI does.
JOBS ?= 2
SLOW ?= 0
test: $(STAMP)
	$(BIN)/python -m pytest -q $(if $(filter 0,$(JOBS)),,-n $(JOBS) --dist loadfile --no-loadscope-reorder) $(if $(filter 1,$(SLOW)),,-m "not slow") $(ARGS)

# ruff over the whole repository, with the settings in pyproject.toml ([tool.ruff]); CI runs it first.
lint: $(STAMP)
	$(BIN)/ruff check .

bench: $(STAMP)
	$(BIN)/python benchmarks/run_all.py $(ARGS)

# The documentation site (mkdocs.yml, docs/) into site/: --strict fails on a broken link, anchor or API reference.
# Its tools are the [docs] extra, installed here only (`make train` and `make test` do not need them).
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) outputs multirun wandb lightning_logs .pytest_cache site

# Both `make demo` and `make test` set themselves up from nothing: a .venv, torch first
# (the CPU wheel on this machine's disk; elsewhere the normal PyPI build), then the package.
PY      := .venv/bin/python
PIP     := $(PY) -m pip
STAMP   := .venv/.installed
EXTRAS  := dev,viz,browser,hf,gpu
# The native engine (engine="cpp") is compiled on first use into torch's extension folder:
# here one inside .venv, so a fresh clone builds it from nothing, as a new user's machine.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.venv/torch-extensions

.PHONY: demo test lint bench browser clean mutate build

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[$(EXTRAS)]"
	touch $(STAMP)

# The native engine's first build takes a minute or two: done here, visibly, before the
# demo or the tests use it (`causalattn build` says the compiler, flags and folder; a
# machine without a C++ compiler still runs the demo and the tests on the other engines).
build: $(STAMP)
	-.venv/bin/causalattn build

demo: build
	.venv/bin/causalattn demo

# Chromium for the browser tests comes from Debian; the tests skip loudly where it cannot.
browser:
	@command -v chromium >/dev/null 2>&1 || (command -v apt-get >/dev/null 2>&1 && \
	  (apt-get update -qq && apt-get install -y -qq chromium >/dev/null 2>&1) || \
	  echo "!!! chromium could not be installed: browser tests will be SKIPPED")

# On WORKERS pytest-xdist processes (CI has 2 cores); tests/conftest.py gives each worker
# its share of the cores and runs ring attention's and the browser's modules whole on one.
WORKERS ?= 2
test: build browser
	$(PY) -m pytest -q -n $(WORKERS)

# ruff's rules, ruff's formatting, then the layers of docs/design.md (.importlinter)
lint: $(STAMP)
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .
	.venv/bin/lint-imports

# Mutation testing (slow: about an hour per module group on 2 busy cores; not in CI).
# Config: [tool.mutmut] in pyproject.toml, each module judged by its own tests
# (tests/conftest.py). Narrow it: make mutate MUTANTS="causalattn.masks*"; CHILDREN workers.
# Results: mutmut results (survivors), mutmut show NAME, mutmut export-cicd-stats.
MUTANTS  ?=
CHILDREN ?= 2
mutate: $(STAMP)
	PATH=$(CURDIR)/.venv/bin:$$PATH nice -n 19 .venv/bin/mutmut run --max-children $(CHILDREN) $(MUTANTS)
	.venv/bin/mutmut results

bench: $(STAMP)
	.venv/bin/causalattn bench

clean:
	rm -rf .venv .pytest_cache .ruff_cache .hypothesis

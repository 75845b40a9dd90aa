# Two commands do all set-up from a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip

.PHONY: demo test lint typecheck unit bench clean serve fuzz

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP) install -q -e '.[service]'
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(PIP) install -q -e '.[service,dev]'
	touch $(VENV)/.installed $@

demo: $(VENV)/.installed
	$(BIN)/kmend demo

serve: $(VENV)/.installed
	$(BIN)/kmend serve

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check .
	$(BIN)/lint-imports

typecheck: $(VENV)/.installed-dev
	$(BIN)/mypy

# Three workers on CI's two cores: the real-job tests wait (a hang's threshold, a finished job's silence), and with
# two workers a quiet run left the cores a fifth idle. Work stealing: the long tests come first and land on one
# worker's share, which the others take from when theirs run out (with plain load balancing they waited idle while
# it ran them one after another, 3 minutes at the end of a run).
PYTEST_WORKERS ?= 3

# The project's modules are compiled once before the run: the tests start `kmend serve` and `kmend agent` a few
# hundred times, and with PYTHONDONTWRITEBYTECODE set (as on CI) each start would compile them again.
unit: $(VENV)/.installed-dev
	$(BIN)/python -m compileall -q -j 2 analyzer collector healer kmend models sim tests
	$(BIN)/pytest -q -n $(PYTEST_WORKERS) --dist worksteal --durations=30

test: lint typecheck unit

# The hostile-input campaign: schemathesis over the OpenAPI schema with the ingest and operator tokens
# (0 5xx, 0 schema violations), then the hostile-input suite (payloads, rules, checkpoints, auth, spool, time).
fuzz: $(VENV)/.installed-dev
	$(BIN)/python bench/fuzz.py --max-examples $${FUZZ_EXAMPLES:-50}
	$(BIN)/pytest -q tests/test_hostile_*.py tests/test_agent_e2e.py

bench: $(VENV)/.installed
	@for b in bench/*.py; do $(BIN)/python $$b; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info

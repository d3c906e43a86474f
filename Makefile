# The two commands of the README. Both create .venv on first use (torch pinned to the CPU build
# that this machine's pip serves from disk), so a fresh clone needs nothing else.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.swarmgrad-installed

.PHONY: demo test bench venv clean-venv

demo: $(STAMP)
	$(VENV)/bin/swarmgrad demo

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(PY) benchmarks/codecs.py
	$(PY) benchmarks/pipeline_overhead.py
	$(PY) benchmarks/round_codecs.py

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

clean-venv:
	rm -rf $(VENV)

# The two commands of the README. Both create .venv on first use (torch pinned to the CPU build
# that this machine's pip serves from disk), so a fresh clone needs nothing else.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.swarmgrad-installed

.PHONY: demo test test-slow bench bench-wan venv clean-venv browser

demo: $(STAMP)
	$(VENV)/bin/swarmgrad demo

# Two pytest-xdist workers (one where the machine has one CPU): one runs the tests that start real
# processes, one at a time, the other everything else (tests/conftest.py, PROCESS_GROUP). More
# workers would gain little: the process tests alone take about as long as all the others.
test: $(STAMP) browser
	$(PY) -m pytest -q -n logical --maxprocesses 2 --dist loadgroup tests

# Debian's chromium for the dashboard's browser tests (tests/test_dashboard_page.py), installed
# when it is missing and we are root; otherwise a note, and those tests skip.
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "installing chromium (apt-get) for the dashboard's browser tests"; \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
		|| { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; } \
		|| echo "note: apt-get could not install chromium: the dashboard's browser tests will skip"; \
	else echo "note: /usr/bin/chromium is missing (install Debian's chromium as root): the dashboard's browser tests will skip"; fi

test-slow: $(STAMP)
	SWARMGRAD_SLOW_TESTS=1 $(PY) -m pytest -q tests/test_rebalance_swarm.py tests/test_nat.py tests/test_join_hold.py tests/test_wan_smoke.py tests/test_public_join.py

bench: $(STAMP)
	$(PY) -m benchmarks.codecs
	$(PY) -m benchmarks.pipeline_overhead
	$(PY) -m benchmarks.round_codecs

# swarmgrad against DDP and hivemind.Optimizer over veth pairs in network namespaces, unshaped and
# tbf 20mbit (needs root; skips otherwise). About an hour on 2 cores; WAN_ARGS=--quick for a smoke run.
bench-wan: $(STAMP)
	$(PY) -m benchmarks.wan --out runs/bench-wan $(WAN_ARGS)

# chaos soak: 6 peers on 2 stages, a random one SIGKILLed and replaced every 20 s for 10 minutes
# (about 12 minutes on 2 cores; CHAOS_ARGS=--quick for a 2-minute smoke run). Not part of make test.
.PHONY: bench-chaos
bench-chaos: $(STAMP)
	$(PY) -m benchmarks.chaos $(CHAOS_ARGS)

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,bench,hf,data]'
	touch $(STAMP)

clean-venv:
	rm -rf $(VENV)

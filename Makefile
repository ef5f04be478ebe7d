# Set-up is part of each target: `make demo` and `make test` work on a fresh machine with
# Python 3.11 and nothing else installed. TORCH pins the CPU build that CI machines carry.
PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
STAMP := $(VENV)/.installed
# The Docker engine for the sandbox's docker backend, a prerequisite of `test`; without root
# or apt-get, run `make test ENGINE=` (its tests skip when no daemon answers).
ENGINE ?= engine
DOCKERD_LOG ?= /tmp/recforge-dockerd.log
# Headless chromium, which the HTML report's rendering test opens the report in; without root
# or apt-get, run `make test BROWSER=` (that test then skips).
BROWSER ?= browser

# bubblewrap, the sandbox that every evaluation's runner runs in (sandbox/isolation.py).
SANDBOX ?= bwrap

.PHONY: demo test lint engine browser bwrap

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VENV)/bin/python -m pip install --quiet "$(TORCH)"
	$(VENV)/bin/python -m pip install --quiet -e ".[agent,test]"
	touch $(STAMP)

demo: $(STAMP) $(SANDBOX)
	$(VENV)/bin/recforge campaign run campaigns/demo.toml

# Two pytest-xdist workers or more (one per core), each test file in one worker, so that a
# module's fixture (campaigns or adversarial candidates run side by side) runs once.
test: $(STAMP) $(SANDBOX) $(ENGINE) $(BROWSER)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q -n auto --dist loadfile

# For development: the same without the tests marked slow (campaigns, the adversarial suite, every
# test over about 2 s on 2 cores): about 2 minutes on 2 cores.
test-fast: $(STAMP) $(SANDBOX)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q -n auto --dist loadfile -m "not slow"

# Nothing to do when a daemon answers. Otherwise, as root on Debian or Ubuntu: install the
# engine (and static busybox, which the sandbox image is built from) and start dockerd without
# systemd, leaving the host's iptables and interfaces alone (containers run without a network).
engine:
	@if docker info >/dev/null 2>&1; then exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1 || [ "$$(id -u)" != 0 ]; then \
		echo "engine: no Docker daemon, and installing one here needs root and apt-get; Docker tests skip"; \
		exit 0; \
	fi; \
	if ! command -v dockerd >/dev/null 2>&1 || [ ! -x /bin/busybox ]; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
			--no-install-recommends docker.io busybox-static >/dev/null || exit 1; \
	fi; \
	nohup dockerd --host=unix:///var/run/docker.sock --iptables=false --ip6tables=false \
		--bridge=none >$(DOCKERD_LOG) 2>&1 & \
	if ! timeout 30 sh -c 'until docker info >/dev/null 2>&1; do sleep 0.2; done'; then \
		echo "engine: dockerd did not answer within 30 s; its log ($(DOCKERD_LOG)):"; \
		cat $(DOCKERD_LOG); exit 1; \
	fi; \
	echo "engine: dockerd started (log: $(DOCKERD_LOG))"

# Nothing to do when bwrap is there (or RECFORGE_BWRAP names one). Otherwise, as root on Debian or
# Ubuntu: install bubblewrap. Without it, evaluations refuse to run (`isolation = "none"` in a
# campaign's [sandbox] runs runners unisolated, for hosts without user namespaces).
bwrap:
	@if command -v bwrap >/dev/null 2>&1 || [ -n "$$RECFORGE_BWRAP" ]; then exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1 || [ "$$(id -u)" != 0 ]; then \
		echo "bwrap: bubblewrap is missing, and installing it here needs root and apt-get"; exit 1; \
	fi; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends bubblewrap >/dev/null || exit 1; \
	echo "bwrap: bubblewrap installed"

# Nothing to do when chromium is there. Otherwise, as root on Debian or Ubuntu: install it.
browser:
	@if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1; then exit 0; fi; \
	if ! command -v apt-get >/dev/null 2>&1 || [ "$$(id -u)" != 0 ]; then \
		echo "browser: no chromium, and installing it here needs root and apt-get; the report's browser test skips"; \
		exit 0; \
	fi; \
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
		--no-install-recommends chromium >/dev/null || exit 1; \
	echo "browser: chromium installed"

lint: $(STAMP)
	$(VENV)/bin/ruff check .

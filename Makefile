# The two commands a newcomer runs: `make run` and `make test`. Both set everything up first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test test-unit test-deps test-postgres setup typecheck bench docs clean

setup: $(STAMP)

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Reinstall when the package metadata or the pins change.
$(STAMP): $(PY) pyproject.toml constraints.txt
	@echo "make: installing goodput and its dependencies into $(VENV) (pip's output: $(VENV)/install.log)"
	@$(PY) -m pip install -q -c constraints.txt -e '.[dev]' > $(VENV)/install.log 2>&1 \
	  || { tail -40 $(VENV)/install.log; echo "make: pip install failed; its whole output is in $(VENV)/install.log"; exit 1; }
	@touch $(STAMP)

# The demo starts over each time: a finished run's checkpoints would make the next one resume at
# its last step with nothing left to train (goodput run resumes a run's latest checkpoint).
run: $(STAMP)
	@for run in tiny-gpt tiny-gpt-replicas; do if [ -d goodput-runs/$$run ]; then echo "make run: removing the last demo's checkpoints (goodput-runs/$$run)"; rm -rf goodput-runs/$$run goodput-runs/$$run.fence; fi; done
	$(VENV)/bin/goodput run examples/tiny-gpt.yaml
	@echo; echo "make run: the same model with one data-parallel replica as the failure domain (examples/tiny-gpt-replicas.yaml)"; echo
	$(VENV)/bin/goodput run examples/tiny-gpt-replicas.yaml

# System packages the tests use: a real Prometheus and promtool (Debian's `prometheus`), kubectl
# (renders deploy/ with its built-in kustomize), and the lab's iproute2 and nftables (network
# namespaces, links cut and dropped: tests/support/lab.py). Without root (or sudo) they cannot be installed, and
# the tests that need them skip saying so.
DEB_TOOLS := prometheus:prometheus promtool:prometheus kubectl:kubectl nft:nftables ip:iproute2 tc:iproute2
test-deps:
	@missing=""; for t in $(DEB_TOOLS); do command -v $${t%%:*} >/dev/null || missing="$$missing $${t##*:}"; done; \
	missing=$$(echo $$missing | tr ' ' '\n' | sort -u | xargs); \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null; then SUDO="sudo -n"; \
	else echo "make: cannot install$$missing (not root, no sudo): the tests that need them will skip"; exit 0; fi; \
	echo "make: installing Debian's $$missing for the tests"; \
	( $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	  --no-install-recommends $$missing >/dev/null ) || echo "make: installing$$missing failed: the tests that need them will skip"

# A real PostgreSQL server for the registry's tests (Debian keeps initdb off PATH).
test-postgres:
	@if command -v initdb >/dev/null || ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null; then SUDO="sudo -n"; \
	else echo "make: cannot install postgresql (not root, no sudo): its tests will skip"; exit 0; fi; \
	echo "make: installing Debian's postgresql for the tests"; \
	( $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
	  --no-install-recommends postgresql >/dev/null ) || echo "make: installing postgresql failed: its tests will skip"

# Under CI (a 90-minute limit for all of .ci/run), pytest ends its session before that limit and prints
# its summary: a run cut off by the limit would say nothing of the tests it had not finished. .ci/run
# says when it started (GOODPUT_CI_STARTED, unix seconds): the session gets what the installs and mypy
# left of the 5400 s, less 150 s for its own teardown and summary; else 80 minutes. tests/tiers.py runs
# the unit tier beside the others at the lowest CPU priority (on 2 cores the cluster tier leaves ~13 %
# idle, and the unit tier is one process).
CI_BUDGET_S := 5400

test: $(STAMP) test-deps test-postgres
	$(PY) -m mypy
	@limit=""; if [ -n "$(CI)" ]; then left=4800; \
	  if [ -n "$${GOODPUT_CI_STARTED:-}" ]; then left=$$(( $(CI_BUDGET_S) - ($$(date +%s) - $$GOODPUT_CI_STARTED) - 150 )); fi; \
	  echo "make: under CI, pytest's sessions end after $$left s"; limit="--session-timeout=$$left"; fi; \
	  echo "$(PY) -m tests.tiers $$limit"; \
	  $(PY) -m tests.tiers $$limit

test-unit: $(STAMP)
	$(PY) -m pytest -q -m "not dist and not cluster" tests

# The documentation site (mkdocs.yml) into site/, strict: a broken link or a page left out fails it.
docs: $(STAMP)
	DISABLE_MKDOCS_2_WARNING=true $(VENV)/bin/mkdocs build --strict --quiet

bench: $(STAMP)
	$(PY) benchmarks/trainer_overhead.py

clean:
	rm -rf $(VENV) goodput-runs site

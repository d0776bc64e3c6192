# The two commands of the quick start: `make demo` and `make test`. Each does its own set-up
# first (scripts/setup.sh: quick when everything is already there).
PYTHON ?= python3
ARGS ?=

.PHONY: demo test

demo:
	@PYTHON=$(PYTHON) scripts/setup.sh demo
	$(PYTHON) -m gateway demo

# ARGS: extra pytest arguments, e.g. make test ARGS='tests/test_deploy.py -x'
test:
	@PYTHON=$(PYTHON) scripts/setup.sh test
	$(PYTHON) -m pytest -q $(ARGS)

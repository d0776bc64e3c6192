# The two commands of the quick start: `make demo` and `make test`.
PYTHON ?= python3

.PHONY: install demo test

install:
	$(PYTHON) -m pip install --quiet --disable-pip-version-check -e '.[test]'

demo: install
	$(PYTHON) -m gateway demo

test: install
	$(PYTHON) -m pytest -q

# One command per gate, the same locally and in CI.
#   make demo    a day on site, offline: real bothy + real codex + a scripted model server
#   make test    the whole test suite (installs what it needs first)
#   make check   ruff + mypy (strict)
#   make bench   benchmarks, printed as figures and ratios
VENV ?= .venv
PY := $(VENV)/bin/python
PY_STAMP := $(VENV)/.installed
NODE_STAMP := node_modules/.installed

.PHONY: install test check bench demo clean

install: $(PY_STAMP) $(NODE_STAMP)

$(PY_STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

# The pinned Codex CLI (package.json + package-lock.json) that tests and the demo drive.
$(NODE_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund
	touch $@

test: install
	$(VENV)/bin/pytest

check: install
	$(VENV)/bin/ruff check bothy tests bench tools
	$(VENV)/bin/mypy

bench: install
	$(PY) -m bench

demo: install
	$(PY) tools/demo.py

clean:
	rm -rf $(VENV) node_modules .demo .bench

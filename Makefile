# One command per gate, the same locally and in CI.
#   make demo    a day on site, offline: real bothy + real codex + a scripted model server
#   make test    the whole test suite (installs what it needs first)
#   make check   ruff + mypy (strict)
#   make bench   benchmarks, printed as figures and ratios
#   make codex-bump VERSION=x.y.z   pin another codex, then rerun the schema check against it
VENV ?= .venv
PY := $(VENV)/bin/python
PY_STAMP := $(VENV)/.installed
NODE_STAMP := node_modules/.installed

.PHONY: install test check bench demo clean codex-bump codex-contract

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

# Pin another Codex CLI and show what it breaks before a site does: the fields Bothy reads
# must exist in its generated schema, and every codex-driving test's traffic must match it.
codex-bump:
	@test -n "$(VERSION)" || { echo "usage: make codex-bump VERSION=x.y.z" >&2; exit 2; }
	npm install --no-audit --no-fund --save-exact @openai/codex@$(VERSION)
	touch $(NODE_STAMP)
	$(MAKE) codex-contract

codex-contract: install
	$(VENV)/bin/pytest tests/test_codex_schema.py -q
	$(VENV)/bin/pytest -m codex -q

bench: install
	$(PY) -m bench

demo: install
	$(PY) tools/demo.py

clean:
	rm -rf $(VENV) node_modules .demo .bench

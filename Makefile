# Two entry points: `make serve` and `make test`. Both set up .venv first.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

.PHONY: install serve test bench
install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/epd-encoder serve

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(VENV)/bin/python $$b --quick || exit 1; done

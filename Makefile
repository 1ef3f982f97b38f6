# Two commands a newcomer needs: `make demo` and `make test`.
# Both create .venv on first use and install what they need into it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# The CPU build of TORCH_VERSION is installed first and then pinned, so no later install can swap
# it for a (multi-GB, CUDA) build from the registry. Where that build is missing the install stops
# and names the CPU builds there are: nothing else is taken in its place.
TORCH_VERSION ?= 2.13.0
TORCH_SPEC    ?= torch==$(TORCH_VERSION)+cpu
CONSTRAINTS := $(VENV)/constraints.txt

.PHONY: demo test test-newest lint unit slow docs bench soak clean

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	@$(PIP) install -q "$(TORCH_SPEC)" || { \
	  echo "Makefile: $(TORCH_SPEC) cannot be installed here; no other torch is taken in its place" \
	    "(the registry's plain torch is a CUDA build of several GB)." >&2; \
	  echo "CPU builds of torch pip can install here:" \
	    "$$($(PIP) index versions torch 2>/dev/null | grep -o '[0-9][0-9.]*+cpu' | sed 's/+cpu//' | sort -u | tr '\n' ' ')" >&2; \
	  echo "Pick one with 'make test TORCH_VERSION=<version>', or run 'make test-newest'" \
	    "for the newest torch of any build." >&2; \
	  exit 1; }
	$(PY) -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > $(CONSTRAINTS)
	touch $@

# The install builds the native kernel (setup.py): installed again when its source changes.
KERNEL := setup.py src/torchsurgery/compact/native_build.py src/torchsurgery/compact/narrow_matvec.cpp

$(VENV)/.cli: $(VENV)/.torch pyproject.toml $(KERNEL)
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[cli]"
	touch $@

$(VENV)/.dev: $(VENV)/.torch pyproject.toml $(KERNEL)
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[dev]"
	touch $@ $(VENV)/.cli

$(VENV)/.bench: $(VENV)/.dev
	$(PIP) install -q -c $(CONSTRAINTS) -e ".[dev,bench]"
	touch $@

demo: $(VENV)/.cli
	mkdir -p out
	$(PY) -m torchsurgery trace --hook 'encoder.layer.*' \
		--text "A cat sat on the mat." --text "Surgery on a live model, undone exactly." \
		--text "Weights streamed from host memory." --text "Activations captured by name." \
		--text "Nothing is downloaded at run time." \
		--out out/trace.safetensors --plot out/trace.png

lint: $(VENV)/.dev
	$(PY) -m ruff check setup.py src tests benchmarks examples
	$(PY) -m mypy

# Tests marked slow are left to `make slow`: the suite must fit CI's time on 2 cores.
unit: $(VENV)/.dev
	$(PY) -m pytest -q -p no:cacheprovider --timeout=600 -m "not slow" $(PYTEST_ARGS)

slow: $(VENV)/.dev
	$(PY) -m pytest -q -p no:cacheprovider --timeout=600 -m slow $(PYTEST_ARGS)

# The site in site/, from docs/ and the docstrings; --strict: a broken link or reference fails
# (not --quiet: mkdocs then drops the warnings before --strict counts them).
docs: $(VENV)/.dev
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

test: lint unit docs

# The long run of the random-surgery state machine (tests/test_undo.py): 5,000 random stacks of
# surgery, copies and saves, each undone and compared bitwise (about 15 minutes on 2 cores).
soak: $(VENV)/.dev
	TORCHSURGERY_HYPOTHESIS_EXAMPLES=5000 $(PY) -m pytest -q -p no:cacheprovider tests/test_undo.py -k SurgeryMachine

# The suite (lint, types, tests, docs) on the newest torch pip offers this machine, whatever its
# build (here a CUDA build of several GB, run on the CPU), in a venv of its own: not part of
# `make test`. The venv keeps the torch it was made with: `rm -r .venv-newest` to take a newer one.
test-newest:
	$(MAKE) test VENV=.venv-newest TORCH_SPEC=torch

bench: $(VENV)/.bench
	@echo "benchmarks: $(PY) benchmarks/<name>.py (see docs/benchmarks.md)"

clean:
	rm -rf .venv .venv-newest build dist site src/*.egg-info .pytest_cache .mypy_cache .ruff_cache

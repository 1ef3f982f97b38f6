# Two commands a newcomer needs: `make demo` and `make test`.
# Both create .venv on first use and install what they need into it.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# torch is installed first and then pinned, so no later install can swap it
# for a (multi-GB, CUDA) build from the registry.
TORCH_VERSION ?= 2.13.0
CONSTRAINTS := $(VENV)/constraints.txt

.PHONY: demo test lint unit slow docs bench soak oldest clean

$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Prefer the local CPU build of the pinned version; fall back to the registry's torch.
	$(PIP) install -q "torch==$(TORCH_VERSION)" || $(PIP) install -q torch
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

# The oldest torch that pyproject.toml claims, in a venv of its own (.venv-oldest), runs the
# suite less the slow tests: `make oldest` (not part of `make test`). `make oldest OLDEST_TORCH=2.11.0
# OLDEST=.venv-2.11` tries another; on x86_64 the registry's torch is a CUDA build of several GB, run on the CPU.
OLDEST_TORCH ?= 2.13.0
OLDEST       := .venv-oldest
OLDEST_PY    := $(OLDEST)/bin/python

$(OLDEST)/.dev: pyproject.toml $(KERNEL)
	$(PYTHON) -m venv $(OLDEST)
	$(OLDEST_PY) -m pip install -q --upgrade pip
	$(OLDEST_PY) -m pip install -q "torch==$(OLDEST_TORCH)"
	echo "torch==$(OLDEST_TORCH)" > $(OLDEST)/constraints.txt
	$(OLDEST_PY) -m pip install -q -c $(OLDEST)/constraints.txt -e ".[dev]"
	touch $@

oldest: $(OLDEST)/.dev
	$(OLDEST_PY) -c "import torch; print('torch', torch.__version__)"
	$(OLDEST_PY) -m pytest -q -p no:cacheprovider --timeout=600 -m "not slow" $(PYTEST_ARGS)

bench: $(VENV)/.bench
	@echo "benchmarks: $(PY) benchmarks/<name>.py (see docs/benchmarks.md)"

clean:
	rm -rf $(VENV) $(OLDEST) build dist site src/*.egg-info .pytest_cache .mypy_cache .ruff_cache

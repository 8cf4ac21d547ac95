# The two commands of README.md: `make demo` and `make test`. Each sets up what it needs.
# `make test-fast` is the inner loop while changing the code (README.md, "Test tiers").
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench gpu-suite setup ffmpeg espeak clean

# uv installs what pip would, in under half the time; pip where uv cannot (scripts/setup_venv.py)
$(STAMP): setup.cfg pyproject.toml constraints.txt scripts/setup_venv.py
	$(PYTHON) scripts/setup_venv.py $(VENV)
	touch $(STAMP)

setup: $(STAMP) ffmpeg espeak

ffmpeg:
	@scripts/ensure_ffmpeg.sh

# espeak-ng speaks the speech-shaped benchmark's English and Amharic
espeak:
	@scripts/ensure_espeak.sh

demo: setup
	$(PY) headlessXttsTrain.py --demo

# Every tier, one pytest worker per core (pytest-xdist): the distributed and client tiers
# start their own processes, which share those cores. worksteal: a worker that runs out of
# tests takes queued ones from the other (the tests last from 0.01 s to a minute).
# PYTHONDONTWRITEBYTECODE (set on some machines, these among them) would make each of the
# suite's hundreds of Python processes compile this repository's modules again: the tests write
# their bytecode once, as a user's runs do.
test: setup
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n auto --dist worksteal

# The unit tier, under a minute on 2 cores: no coqui (xtts), nothing slow (subprocess
# matrices, real trainings), no torchrun (distributed). --check-markers (tests/conftest.py)
# fails a test run here that imports coqui, and lists (never fails) one whose call takes over 2 s.
FAST := not slow and not xtts and not distributed
test-fast: setup
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -m "$(FAST)" --check-markers

bench: setup
	$(PY) benchmarks/run.py

# GPU validation suite (benchmarks/gpu): skipped without a CUDA GPU; results in
# benchmarks/gpu/results/gpu_suite.{json,md} (GPU_SUITE_OUT=... to write elsewhere)
gpu-suite: setup
	$(PY) -m pytest benchmarks/gpu -q -p no:cacheprovider

clean:
	rm -rf $(VENV) build *.egg-info

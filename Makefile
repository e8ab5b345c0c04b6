# The two entry points are `make run` and `make test`; both prepare everything they need.
SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)
# The wheel that provides libmlx.so: mlx-cpu here, a CUDA wheel on a GPU machine.
MLX_WHEEL ?= mlx-cpu
export MLX_WHEEL

FIXTURES := cargo build --manifest-path tests/fixtures/Cargo.toml --target-dir target/fixtures

ORACLE_PY := tests/oracle/.venv/bin/python
BENCH_MODEL := target/bench-model

.PHONY: help setup build fixtures run serve test doctor oracle bench bench-large demo-model training-smoke \
	train-drafter demo-drafters drafter-bench replicas check-platforms oracle-venv llamacpp bench-llamacpp gpu-check
.DEFAULT_GOAL := help

help: ## this list
	@awk -F ':.*## ' '/^[a-z-]+:.*## / {printf "  make %-16s %s\n", $$1, $$2}' $(MAKEFILE_LIST)

setup: ## install what the build needs (apt packages, MLX, mlx-c, bindings) into .native/
	@bash scripts/setup.sh

build: setup ## build the host and the shipped plugins (release)
	cargo build --workspace --release

# Test libraries, kept out of the plugins directory the host uses by default.
fixtures: setup ## build the test plugins, apart from the default plugins directory
	$(FIXTURES)

# Generates text with the embedded default manifest (the trained demo target, models/kjv-gemma4,
# drafted by prompt lookup, greedy), then decodes it again plainly to say how much faster it ran.
run: build ## the main job: generate on the embedded default, then compare with plain decoding
	./target/release/host run --manifest manifests/default.toml --compare-plain

# An OpenAI-compatible server on the embedded default, at http://127.0.0.1:8080/v1.
serve: build ## an OpenAI-compatible server on the embedded default at 127.0.0.1:8080
	./target/release/host serve --manifest manifests/default.toml

# On a machine with an NVIDIA GPU: the route CUDA takes against mlx-lm on the same GPU, and every
# demo drafter's speed-up and exactness there (scripts/gpu-check.sh; docs/gpu.md).
gpu-check: ## on an NVIDIA GPU: plain decoding against mlx-lm, every demo drafter's speed-up and exactness
	bash scripts/gpu-check.sh

# Two `host serve` replicas behind Debian's nginx on loopback (installed if missing): requests
# sent through nginx reach both (scripts/replicas.sh; not part of the tests).
replicas: build ## two `host serve` replicas behind nginx on loopback
	bash scripts/replicas.sh

# Then once more on the route Metal and CUDA take, MLX's own ops for everything
# (HOST_KERNELS=mlx), on this machine's CPU: the target's and the drafters' parity with their
# references, and speculative output equal to plain. The 4-bit fixture sits that run out: its
# oracle sums quantized products in float32 as Metal, CUDA and the host's kernels do, where
# MLX's CPU kernel rounds to bfloat16 at every step (tests/oracle/README.md). The kernels' own
# tests run again without the tile unit (with the target's parity and speculative output equal
# to plain: on a CPU with AMX the AVX-512 routes would go untested), on AVX-512 without BF16
# (as Skylake-SP to Ice Lake run it: the target's parity, speculative output and trees equal to
# plain), on the AVX2 loops (with the target's parity), on the portable loops and with 8-bit
# activations for quantized products.
MLX_ROUTE_TESTS := --test gemma4_parity --test speculative --test plain_decoding --test round_trips --test assistant --test dflash --test dspark \
	--test deepspec --test trained_drafters
NO_UNIT_TESTS := --test gemma4_parity --test speculative --test plain_decoding --test round_trips --test trees --test trained_drafters
test: setup fixtures training-smoke check-platforms ## every test: Rust (both kernel routes), training smoke, platforms, docs
	bash tests/clients/setup.sh
	cargo build --workspace
	cargo test --workspace
	HOST_KERNELS=mlx cargo test -p host $(MLX_ROUTE_TESTS) -- --skip quantized_4_bit
	HOST_AMX=off cargo test -p kernels
	HOST_AMX=off cargo test -p host $(NO_UNIT_TESTS)
	HOST_SIMD=avx512-nobf16 cargo test -p kernels
	HOST_SIMD=avx512-nobf16 cargo test -p host --test gemma4_parity --test speculative --test trees
	HOST_SIMD=avx2 cargo test -p kernels
	HOST_SIMD=avx2 cargo test -p host --test gemma4_parity
	HOST_SIMD=portable cargo test -p kernels
	HOST_QUANTIZED_ACTIVATIONS=int8 cargo test -p kernels

# The workspace type-checked for macOS on Apple silicon and for Windows, which CI cannot run:
# every platform path compiles there (nothing is linked or run).
check-platforms: setup ## type-check the workspace for macOS (Apple silicon) and Windows
	bash scripts/check-platforms.sh

# The training scripts on a tiny configuration: the loss falls and an interrupted run resumes.
training-smoke: ## the training scripts on tiny presets
	bash training/setup.sh
	training/.venv/bin/python training/smoke_test.py

# Reproduces the demo target from the corpus (about 66 minutes on 2 cores; resumes if interrupted):
# trains, writes models/kjv-gemma4 (bfloat16), measures it on the held-out text.
demo-model: ## retrain the demo target models/kjv-gemma4 from the corpus (about an hour)
	bash training/setup.sh
	training/.venv/bin/python training/train_target.py
	training/.venv/bin/python training/evaluate_target.py

# Trains a drafter of KIND (dflash, dspark, deepspec, assistant; lookup writes a token datastore)
# for the Gemma 4 checkpoint in TARGET and writes it to OUT (default: beside TARGET,
# <TARGET>-<KIND>); resumes if interrupted.
KIND ?= dflash
TARGET ?= models/kjv-gemma4
OUT ?= $(TARGET)-$(KIND)
train-drafter: ## train a drafter: KIND=dflash|dspark|deepspec|assistant|lookup TARGET=DIR [OUT=DIR]
	bash training/setup.sh
	training/.venv/bin/python training/train_$(KIND).py --target $(TARGET) --out $(OUT)

# Reproduces the demo drafters (the four learned ones 7 to 17 minutes each on 2 cores, the
# lookup datastore about 10; about an hour in all) and records each learned one's drafts in
# its reference implementation for the tests (tests/fixtures/kjv-demo).
demo-drafters: ## retrain the demo drafters and re-record their reference drafts
	for kind in dflash dspark deepspec assistant lookup; do $(MAKE) train-drafter KIND=$$kind || exit 1; done
	bash tests/oracle/setup-venv.sh
	$(ORACLE_PY) tests/oracle/dflash_oracle.py --trained models/kjv-gemma4-dflash
	$(ORACLE_PY) tests/oracle/dspark_oracle.py --trained models/kjv-gemma4-dspark
	$(ORACLE_PY) tests/oracle/deepspec_oracle.py --trained models/kjv-gemma4-deepspec
	bash tests/oracle/setup-venv-hf.sh
	tests/oracle/.venv-hf/bin/python tests/oracle/assistant_oracle.py --trained models/kjv-gemma4-assistant

# Every demo drafter (and prompt lookup alone) at every draft length on 20 held-out prompts greedy,
# and at two lengths sampled (match, and rejection where the drafter returns probabilities),
# against plain decoding: models/kjv-gemma4/drafters.md and drafters.png (4 to 55 minutes on 2 cores).
DEMO_DRAFTERS := manifests/demo-dflash.toml,manifests/demo-dspark.toml,manifests/demo-deepspec.toml,manifests/demo-assistant.toml,manifests/demo-lookup.toml,manifests/demo-ngram.toml,manifests/demo-dflash-rejection.toml,manifests/demo-dspark-rejection.toml,manifests/demo-deepspec-rejection.toml
drafter-bench: build ## every demo drafter at every draft length against plain decoding
	./target/release/host bench --sweep $(DEMO_DRAFTERS) \
	  --prompts-file models/kjv-gemma4/bench-prompts.jsonl --draft-tokens 1,2,3,4,6,8,auto --max-tokens 256 \
	  --temperature 0.7 --top-p 0.95 --sampled-draft-tokens 2,4,auto \
	  --plot models/kjv-gemma4/drafters.png | tee models/kjv-gemma4/drafters.md

doctor: build ## what MLX, BLAS, route and plugins directory this build uses
	./target/release/host doctor

# Regenerates the oracle fixtures, each oracle in its own venv (tests/oracle): the target with
# mlx-lm, dflash with dflash 0.1.0 (same venv), the assistant drafter with transformers (a
# large download: torch with CUDA wheels).
oracle: setup ## regenerate the oracle fixtures with the reference implementations
	bash tests/oracle/setup-venv.sh
	$(ORACLE_PY) tests/oracle/gemma4_oracle.py
	$(ORACLE_PY) tests/oracle/demo_oracle.py
	$(ORACLE_PY) tests/oracle/dflash_oracle.py
	$(ORACLE_PY) tests/oracle/dspark_oracle.py
	$(ORACLE_PY) tests/oracle/deepspec_oracle.py
	bash tests/oracle/setup-venv-hf.sh
	tests/oracle/.venv-hf/bin/python tests/oracle/assistant_oracle.py

# The bench checkpoints (made once under target/, not committed): random Gemma 4s written by the
# oracle, and mlx-lm's conversions of them to bfloat16, float32, and 8 and 4 bits (group 64,
# bfloat16 scales: what users download). target/kjv-gemma4 links the demo target's files, so
# that its conversions are made the same way; its config names `expert_intermediate_size` (none),
# which llama.cpp's converter requires of every Gemma 4.
MLX_CONVERT := $(ORACLE_PY) -m mlx_lm convert
oracle-venv:
	bash tests/oracle/setup-venv.sh
target/bench-model/config.json: | oracle-venv
	$(ORACLE_PY) tests/oracle/gemma4_oracle.py --bench $(@D)
target/bench-model-262k/config.json: | oracle-venv
	$(ORACLE_PY) tests/oracle/gemma4_oracle.py --bench $(@D) --bench-vocab 262144
target/bench-model-large/config.json: | oracle-venv
	$(ORACLE_PY) tests/oracle/gemma4_oracle.py --bench $(@D) --bench-large
target/kjv-gemma4/config.json: models/kjv-gemma4/config.json
	mkdir -p $(@D) && for f in model.safetensors tokenizer.json tokenizer_config.json generation_config.json; do \
		ln -sfn ../../models/kjv-gemma4/$$f $(@D)/$$f; done
	python3 -c 'import json,sys; c=json.load(open(sys.argv[1])); c.setdefault("expert_intermediate_size", None); \
		json.dump(c, open(sys.argv[2], "w"), indent=2)' $< $@
target/%-q4/config.json: target/%/config.json | oracle-venv
	rm -rf $(@D) && $(MLX_CONVERT) --hf-path target/$* --mlx-path $(@D) -q --q-bits 4 --q-group-size 64 --dtype bfloat16
target/%-q8/config.json: target/%/config.json | oracle-venv
	rm -rf $(@D) && $(MLX_CONVERT) --hf-path target/$* --mlx-path $(@D) -q --q-bits 8 --q-group-size 64 --dtype bfloat16
target/%-bf16/config.json: target/%/config.json | oracle-venv
	rm -rf $(@D) && $(MLX_CONVERT) --hf-path target/$* --mlx-path $(@D) --dtype bfloat16
target/%-f32/config.json: target/%/config.json | oracle-venv
	rm -rf $(@D) && $(MLX_CONVERT) --hf-path target/$* --mlx-path $(@D) --dtype float32
.PRECIOUS: target/%/config.json

# The host alone on a random Gemma 4 of 1.3B parameters, which no CPU cache holds: decoding
# bound by memory, as on real checkpoints (5 GB in float32, 2.6 GB in bfloat16, 1.4 and 0.7 GB
# in 8 and 4 bits). mlx-lm's CPU kernels would take minutes per run.
LARGE := bench-model-large bench-model-large-bf16 bench-model-large-q8 bench-model-large-q4
bench-large: build $(LARGE:%=target/%/config.json) ## the host on a random 1.3B Gemma 4, bound by memory
	for m in bench-large bench-large-bf16 bench-large-q8 bench-large-q4; do \
		./target/release/host bench --manifest manifests/$$m.toml --pairs 2 --no-mlx-lm; done

# The host against llama.cpp (built from the llama-cpp-python 0.3.36 sdist into target/llamacpp,
# scripts/llamacpp/build.sh), decode of 128 tokens and prefill of 512 at two threads, on the demo
# target and the 40M and 1.3B bench models in float32, bfloat16, 8 and 4 bits: GGUFs made by
# llama.cpp's own converter and llama-quantize, against the matching MLX checkpoints. Writes
# target/llamacpp/results/results.{md,json} (about 30 minutes on 2 cores, the first run more).
# HOST_SIMD=avx2 (or HOST_AMX=off) measures a narrower route of the host's on the same machine.
LLAMACPP := target/llamacpp
GGUF_CONVERT := $(LLAMACPP)/convert-venv/bin/python $(LLAMACPP)/llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py
LLAMACPP_MODELS := kjv-gemma4 bench-model bench-model-large
GGUFS := $(foreach m,$(LLAMACPP_MODELS),$(foreach f,f32 bf16 q8_0 q4_0,$(LLAMACPP)/gguf/$(m)-$(f).gguf))
MLX_FORMATS := $(foreach m,$(LLAMACPP_MODELS),$(m)-q4 $(m)-q8) kjv-gemma4-f32 bench-model-bf16 bench-model-large-bf16
llamacpp:
	bash scripts/llamacpp/build.sh
$(LLAMACPP)/gguf/%-f32.gguf $(LLAMACPP)/gguf/%-bf16.gguf $(LLAMACPP)/gguf/%-q8_0.gguf: target/%/config.json | llamacpp
	mkdir -p $(@D)
	for t in f32 bf16 q8_0; do log=$(@D)/$*-$$t.log; \
		$(GGUF_CONVERT) target/$* --outtype $$t --outfile $(@D)/$*-$$t.gguf >$$log 2>&1 || { tail -5 $$log; exit 1; }; done
$(LLAMACPP)/gguf/%-q4_0.gguf: $(LLAMACPP)/gguf/%-f32.gguf | llamacpp
	$(LLAMACPP)/build/bin/llama-quantize $< $@ q4_0 >/dev/null
# LLAMA_BENCH_ARGS="--repack 0" where llama.cpp's AMX path crashes (docs/performance.md).
PAIRS ?= 3
LLAMA_BENCH_ARGS ?=
bench-llamacpp: build llamacpp $(MLX_FORMATS:%=target/%/config.json) $(GGUFS) ## the host against llama.cpp, every format
	python3 scripts/llamacpp/bench.py --out $(LLAMACPP)/results --pairs $(PAIRS) --llama-bench-args "$(LLAMA_BENCH_ARGS)"

# Host against mlx-lm on a random Gemma 4 of more than 20M parameters (made once, not committed).
bench: build target/bench-model/config.json target/bench-model-262k/config.json target/bench-model-q8/config.json \
		target/bench-model-q4/config.json ## the host against mlx-lm on random Gemma 4 checkpoints, and the kernels
	./target/release/host bench --kernels
	./target/release/host bench --manifest manifests/bench.toml --mlx-lm-python $(ORACLE_PY)
	./target/release/host bench --manifest manifests/bench-262k.toml --mlx-lm-python $(ORACLE_PY)
	./target/release/host bench --manifest manifests/bench-q8.toml --mlx-lm-python $(ORACLE_PY)
	./target/release/host bench --manifest manifests/bench-q4.toml --mlx-lm-python $(ORACLE_PY)
	./target/release/host bench --manifest manifests/bench-ngram.toml
	./target/release/host bench --manifest manifests/assistant.toml
	./target/release/host bench --manifest manifests/dflash.toml
	./target/release/host bench --manifest manifests/dspark.toml
	./target/release/host bench --manifest manifests/deepspec.toml

# ingot — the two commands a newcomer needs: `make run` and `make test`.
SHELL := /bin/bash
CARGO ?= cargo
PROMPT ?= What is the capital of France? Answer in one sentence.

.PHONY: serve run test model build bench-cpu fixtures
PORT ?= 8000
# Where cargo builds. `make test` runs the synthetic-model example as `cargo test --workspace`
# built it: `cargo run -p ingot-model` would rebuild the dependencies with that package's
# features alone (about 3 minutes of CI).
TARGET_DIR ?= $(or $(CARGO_TARGET_DIR),target)

model:
	@scripts/fetch-test-model >/dev/null

build:
	$(CARGO) build --release -p ingot

# Fetch the default model if missing, build, and serve it (OpenAI API) on port 8000.
serve: model build
	./target/release/ingot serve --model "$$(scripts/fetch-test-model)" --served-model-name smollm2 --port $(PORT)

# Fetch the default model if missing, build, and generate a short chat answer.
run: model build
	./target/release/ingot generate --model "$$(scripts/fetch-test-model)" --chat --prompt "$(PROMPT)" --max-tokens 64

# Everything CI checks: formatting, lints, the Rust tests (the CUDA kernels compile with
# NVRTC from PyPI; the CUDA tests that need a GPU run on the GPU machine, scripts/gpu/run;
# the wgpu tests run on Mesa's lavapipe, and the wgpu conformance suite and a model test
# again on a lavapipe with cooperative matrices, scripts/fetch-coop-lavapipe), and the Python suite that drives `ingot serve`
# with the official openai client, headless Chromium (the chat page) and Prometheus (its
# venv lives in ~/.cache/ingot); the openai-client part again on a synthetic Qwen3-MoE (on
# one device, then split over two CPU ranks) and on a synthetic Qwen3 over two CPU ranks
# (--tensor-parallel-size 2).
# scripts/install-test-packages installs lavapipe, Chromium
# and Prometheus from Debian's packages where missing.
test: model
	scripts/install-test-packages
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --all-targets --all-features -- -D warnings
	INGOT_CUDA_LIB_DIR="$$(scripts/fetch-nvrtc)" $(CARGO) test --workspace
	coop="$$(scripts/fetch-coop-lavapipe)" && for t in "wgpu_ops" "wgpu_models products_on_cooperative"; do \
	  INGOT_WGPU_COOPERATIVE_MATRIX=1 CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="$$coop" \
	  INGOT_CUDA_LIB_DIR="$$(scripts/fetch-nvrtc)" $(CARGO) test --workspace --test $$t || exit 1; done
	cd tests/python && "$$(../../scripts/python-test-env)" -m pytest -q
	$(TARGET_DIR)/debug/examples/synthetic qwen3_moe target/synthetic-qwen3-moe \
	  vocab=32000 hidden=256 layers=2 heads=4 kv_heads=2 head_dim=64 experts=16 per_token=4 \
	  expert_width=128 max_positions=4096
	cd tests/python && INGOT_TEST_MODEL="$(CURDIR)/target/synthetic-qwen3-moe" \
	  "$$(../../scripts/python-test-env)" -m pytest -q test_openai_client.py
	cd tests/python && INGOT_TEST_MODEL="$(CURDIR)/target/synthetic-qwen3-moe" \
	  INGOT_SERVE_ARGS="--tensor-parallel-size 2" \
	  "$$(../../scripts/python-test-env)" -m pytest -q test_openai_client.py
	$(TARGET_DIR)/debug/examples/synthetic qwen3 target/synthetic-qwen3 \
	  vocab=32000 hidden=256 intermediate=512 layers=2 heads=4 kv_heads=2 head_dim=64 max_positions=4096
	cd tests/python && INGOT_TEST_MODEL="$(CURDIR)/target/synthetic-qwen3" \
	  INGOT_SERVE_ARGS="--tensor-parallel-size 2" \
	  "$$(../../scripts/python-test-env)" -m pytest -q test_openai_client.py

# Side-by-side CPU throughput with llama.cpp on the same GGUF (builds llama-bench once).
bench-cpu: model build
	bench/cpu-vs-llama-cpp.sh

# Regenerate the transformers fixtures (needs torch, transformers, gguf, accelerate).
fixtures: model
	python3 tools/reference/make_fixtures.py "$$(scripts/fetch-test-model)" tests/fixtures/smollm2

# The two entry points are `make run` and `make test`; both prepare everything they need.
SHELL := /bin/bash
export PATH := $(HOME)/.cargo/bin:$(PATH)
# The wheel that provides libmlx.so: mlx-cpu here, a CUDA wheel on a GPU machine.
MLX_WHEEL ?= mlx-cpu
export MLX_WHEEL

FIXTURES := cargo build --manifest-path tests/fixtures/Cargo.toml --target-dir target/fixtures

.PHONY: setup build fixtures run test doctor

setup:
	@bash scripts/setup.sh

build: setup
	cargo build --workspace --release

# Test libraries, kept out of the plugins directory the host uses by default.
fixtures: setup
	$(FIXTURES)

run: build
	./target/release/host doctor

test: setup fixtures
	cargo build --workspace
	cargo test --workspace

doctor: build
	./target/release/host doctor

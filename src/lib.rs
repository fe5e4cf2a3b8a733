//! celer: a low-latency inference engine for image model graphs (segmentation -> trimap
//! -> matting), served over the SageMaker container contract. docs/architecture.md maps
//! the layers (tests/layers.rs holds them); each module's header says what it owns.

#![deny(unsafe_code)]

// The ground floor: imports nothing of celer's.
pub mod host;
pub mod matte;
pub mod oip;
pub mod pixels;
pub mod spec;
pub mod stats;
pub mod tensor;
pub mod trace;

// Bindings and backends.
pub mod ort;
// FFI: the TensorRT shim (only compiled with the `tensorrt` feature). Every unsafe block
// there carries a SAFETY comment.
#[allow(unsafe_code)]
pub mod tensorrt;

// The CPU stages, the codec, the GPU and its engines.
pub mod codec;
pub mod stages;
// FFI with the CUDA driver and NVRTC: the one module (with src/tensorrt) allowed `unsafe`,
// each block with a `// SAFETY:` comment.
#[allow(unsafe_code)]
pub mod cuda;
pub mod engines;
// Reduced-precision variants of the models, made offline by `celer build`.
pub mod quantize;

// Scheduling, the replicas, the front end and the tools.
pub mod bench;
pub mod cli;
pub mod config;
pub mod http;
pub mod replica;
pub mod sched;

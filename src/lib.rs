//! celer: a low-latency inference engine for image model graphs (segmentation -> trimap
//! -> matting), served over the SageMaker container contract. docs/architecture.md maps
//! the layers; each module's header says what it owns.

#![deny(unsafe_code)]

pub mod atomic_write;
pub mod backend;
pub mod bench;
pub mod cli;
pub mod codec;
pub mod config;
// FFI with the CUDA driver and NVRTC: the one module (with src/tensorrt) allowed `unsafe`,
// each block with a `// SAFETY:` comment.
#[allow(unsafe_code)]
pub mod cuda;
pub mod engines;
pub mod http;
pub mod pipeline;
pub mod replica;
pub mod sched;
// FFI: the TensorRT shim (only compiled with the `tensorrt` feature) and the CUDA driver
// probe. Every unsafe block there carries a SAFETY comment.
#[allow(unsafe_code)]
pub mod tensorrt;

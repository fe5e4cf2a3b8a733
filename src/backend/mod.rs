//! Model execution backends. A backend runs one ONNX model on one device; a replica owns
//! one instance per model, so `run` takes `&mut self` and needs no lock. ONNX Runtime
//! (CPU) here; TensorRT engines run on a GPU replica's stream (`crate::cuda::trt_model`,
//! behind the cargo feature `tensorrt`). Whether a model fits the pipeline is the replica
//! layer's contract check (`crate::replica::contract`), the same for both.

pub mod block_cache;
pub mod ort;
// FFI: the allocator ONNX Runtime calls back. Every unsafe block carries a SAFETY comment.
#[allow(unsafe_code)]
pub mod ort_allocator;

/// A failure inside a backend: always the server's fault, never the client's.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("ONNX Runtime library not found: {0}")]
    LibraryMissing(String),
    #[error("ONNX Runtime environment: {0}")]
    Environment(String),
    #[error("cannot load model {model}: {reason}")]
    Load { model: String, reason: String },
    #[error("model {model} does not fit the pipeline description: {reason}")]
    Mismatch { model: String, reason: String },
    #[error("inference failed in {model}: {reason}")]
    Run { model: String, reason: String },
}

/// A dense f32 tensor returned by a model, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

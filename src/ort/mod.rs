//! ONNX Runtime: finding and loading its library, the process-wide environment, one
//! session per model per replica (`session`: a replica owns its sessions, so `run` takes
//! `&mut self` and needs no lock), and the allocator and block cache its activations come
//! from. It knows nothing of images or the pipeline: inputs are NCHW f32. TensorRT
//! engines are `crate::cuda::trt_model`'s; whether a model fits the pipeline is the
//! replica layer's contract check, the same for both.

pub mod block_cache;
pub mod session;
// FFI: the allocator ONNX Runtime calls back. Every unsafe block carries a SAFETY comment.
#[allow(unsafe_code)]
pub mod allocator;

/// A failure inside ONNX Runtime: always the server's fault, never the client's. Clone, so
/// that the process-wide environment's failure is every caller's.
#[derive(Debug, Clone, thiserror::Error)]
pub enum OrtError {
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

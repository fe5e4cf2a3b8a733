//! Model execution backends. A backend runs one ONNX model on one device; the pipeline
//! owns one instance per replica, so `run` takes `&mut self` and needs no lock.
//! ONNX Runtime (CPU) here; TensorRT engines run inside the GPU pipeline
//! (`crate::cuda::model`), behind the cargo feature `tensorrt`.

pub mod ort;

/// A failure inside a backend: always the server's fault, never the client's.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("ONNX Runtime library not found: {0}")]
    LibraryMissing(String),
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

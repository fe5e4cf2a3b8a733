//! Why a GPU replica failed, whichever library said it: CUDA, TensorRT or ONNX Runtime
//! (each keeps its own error), or a model that does not fit its contract. A leaf: the
//! stages import it, and it imports none of them.

use std::sync::Arc;

use crate::cuda::driver::DriverError;
use crate::cuda::trt_model::TrtModelError;
use crate::cuda::CudaError;
use crate::engines::plan::PlanError;
use crate::ort::OrtError;
use crate::replica::models::ModelError;
use crate::tensorrt::TrtError;

/// Why a GPU replica's stages failed: CUDA (the driver, the kernels, their buffers),
/// TensorRT (its engines' contexts and enqueues), ONNX Runtime (the models' sessions where
/// TensorRT is absent), a model that does not fit its contract, or an engine the pipeline
/// cannot run.
#[derive(Debug, thiserror::Error)]
pub enum GpuError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error(transparent)]
    TensorRt(#[from] TrtError),
    #[error(transparent)]
    Ort(#[from] OrtError),
    #[error(transparent)]
    Model(#[from] ModelError),
    /// An engine the pipeline cannot run (an output of data-dependent shape).
    #[error(transparent)]
    Engine(TrtModelError),
    /// Opening the GPU failed: every replica of it gets this same error.
    #[error(transparent)]
    Open(Arc<OpenError>),
    /// The replica's pipeline is gone: the GPU is being reopened, or its reopening failed.
    #[error("{device} replica {replica}: not loaded (the GPU is being reopened)")]
    NotLoaded { device: String, replica: usize },
    /// The GPU was lost where it cannot come back in this process: nothing runs on it.
    #[error("{device}: lost, and out of service until the process restarts")]
    LostForGood { device: String },
    #[error("{device}: no slot for replica {replica}")]
    NoSlot { device: String, replica: usize },
    /// The lost context outlived celer's references and could not be reset.
    #[error("{device}: resetting the lost context: {source}")]
    Reset { device: String, source: CudaError },
}

/// Why a GPU could not be opened: its context, or its engines.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error("{device} ({name}): {source}")]
    Device {
        device: String,
        name: String,
        source: CudaError,
    },
    #[error("{device}: {source}")]
    Bind { device: String, source: DriverError },
    #[error(transparent)]
    Engines(#[from] PlanError),
}

impl From<DriverError> for GpuError {
    fn from(error: DriverError) -> Self {
        Self::Cuda(error.into())
    }
}

impl From<TrtModelError> for GpuError {
    fn from(error: TrtModelError) -> Self {
        match error {
            TrtModelError::Cuda(e) => Self::Cuda(e),
            TrtModelError::TensorRt(e) => Self::TensorRt(e),
            other => Self::Engine(other),
        }
    }
}

impl GpuError {
    /// Whether the GPU's context is lost (see `CudaError::is_device_lost`).
    pub fn is_device_lost(&self) -> bool {
        matches!(self, Self::Cuda(e) if e.is_device_lost())
    }
}

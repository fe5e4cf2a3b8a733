//! A model's tensor on the device, in the element type the model takes or gives: what the
//! preprocessing kernels write and an engine reads, or what an engine writes.

use std::sync::Arc;

use super::driver::{CudaSlice, CudaStream};
use half::f16;

use super::launch::ModelInput;
use super::CudaError;

/// The element type of a model tensor celer writes or reads on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorElement {
    F32,
    F16,
}

/// A model tensor on the device.
pub enum GpuTensor {
    F32(CudaSlice<f32>),
    F16(CudaSlice<f16>),
}

impl GpuTensor {
    /// `len` zeroed elements (at least one) on `stream`.
    pub fn alloc(
        stream: &Arc<CudaStream>,
        element: TensorElement,
        len: usize,
    ) -> Result<Self, CudaError> {
        let len = len.max(1);
        Ok(match element {
            TensorElement::F32 => Self::F32(stream.alloc_zeros(len)?),
            TensorElement::F16 => Self::F16(stream.alloc_zeros(len)?),
        })
    }

    pub fn len(&self) -> usize {
        match self {
            Self::F32(b) => b.len(),
            Self::F16(b) => b.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Where the preprocessing kernels write.
    pub fn as_model_input(&mut self) -> ModelInput<'_> {
        match self {
            Self::F32(b) => ModelInput::F32(b),
            Self::F16(b) => ModelInput::F16(b),
        }
    }

    /// The buffer as float32, which ONNX Runtime's inputs are downloaded from.
    pub fn as_f32(&self) -> Result<&CudaSlice<f32>, CudaError> {
        match self {
            Self::F32(b) => Ok(b),
            Self::F16(_) => Err(CudaError::Stage {
                stage: "model",
                reason: "a float32 tensor was expected; this one is float16".into(),
            }),
        }
    }

    /// The device address, for binding to an engine.
    pub(crate) fn address(&self) -> u64 {
        match self {
            Self::F32(b) => b.device_ptr(),
            Self::F16(b) => b.device_ptr(),
        }
    }
}

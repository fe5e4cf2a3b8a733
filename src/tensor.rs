//! A dense f32 tensor, row-major: what a model gives back, whichever runtime ran it (ONNX
//! Runtime on the CPU, or a GPU model's output brought to the host), and what the CPU
//! stages read a mask from. The ground floor.

/// A dense f32 tensor returned by a model, row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: Vec<f32>,
}

//! The model stages of a GPU replica. With TensorRT, an execution context reads the
//! preprocessed input (f32 or f16) and writes its output (f32, or f16 converted by a
//! kernel) in device memory, enqueued on the replica's stream between the kernels:
//! nothing crosses the bus. Where TensorRT is absent, ONNX
//! Runtime runs the model on the CPU: the input comes down, the output goes up, at the
//! cost of one synchronisation per model. `GpuPipeline` owns one `GpuModel` per model.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr as _};
use half::f16;

use super::launch::{Launcher, ModelInput};
use super::CudaError;
use crate::backend::ort::OrtModel;
use crate::tensorrt::{
    CudaStream as TrtStream, DataType, DevicePtr, Engine, ExecutionContext, TensorDesc,
};

/// A model input on the device, in the element type the model takes.
pub enum DeviceTensor {
    F32(CudaSlice<f32>),
    F16(CudaSlice<f16>),
}

impl DeviceTensor {
    pub fn alloc(
        stream: &Arc<CudaStream>,
        element: InputElement,
        len: usize,
    ) -> Result<Self, CudaError> {
        let len = len.max(1);
        Ok(match element {
            InputElement::F32 => Self::F32(stream.alloc_zeros(len)?),
            InputElement::F16 => Self::F16(stream.alloc_zeros(len)?),
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

    /// The f32 buffer that ONNX Runtime's input is downloaded from.
    pub fn as_f32(&self) -> Result<&CudaSlice<f32>, CudaError> {
        match self {
            Self::F32(b) => Ok(b),
            Self::F16(_) => Err(CudaError::Stage {
                stage: "model",
                reason: "ONNX Runtime takes float32 inputs; this buffer is float16".into(),
            }),
        }
    }

    fn address(&self, stream: &CudaStream) -> u64 {
        match self {
            Self::F32(b) => b.device_ptr(stream).0,
            Self::F16(b) => b.device_ptr(stream).0,
        }
    }
}

/// The element type of a model input that celer's preprocessing writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InputElement {
    F32,
    F16,
}

/// One model of one GPU replica.
pub enum GpuModel {
    TensorRt(TrtModel),
    /// Where TensorRT is absent: ONNX Runtime on the CPU.
    OnnxRuntime(OrtModel),
}

impl GpuModel {
    pub fn label(&self) -> &str {
        match self {
            Self::TensorRt(m) => &m.label,
            Self::OnnxRuntime(m) => m.label(),
        }
    }

    /// The element type of input `name` (ONNX Runtime: always f32).
    pub fn input_element(&self, name: &str) -> Result<InputElement, CudaError> {
        match self {
            Self::TensorRt(m) => m.input_element(name),
            Self::OnnxRuntime(_) => Ok(InputElement::F32),
        }
    }
}

/// An engine's execution context with its input shapes fixed for one image per
/// enqueue; the replica owns it and its stream.
pub struct TrtModel {
    context: ExecutionContext,
    label: String,
    inputs: Vec<(String, InputElement, usize)>,
    output: String,
    output_shape: [usize; 4],
    /// Whether `bind` gave every input and the output an address.
    bound: bool,
    /// Where a float16 output is written before `f16_to_f32` makes it the f32 plane the
    /// kernels read; `None` for a float32 output, bound straight to the caller's buffer.
    half_output: Option<CudaSlice<f16>>,
    /// Outputs the pipeline does not read (U2Net's side outputs): TensorRT writes every
    /// output, so each gets a scratch buffer, bound once.
    _unread_outputs: Vec<CudaSlice<u8>>,
    /// The context's activation memory, from the device's memory pool (cudarc allocates
    /// stream-ordered); declared after `context`, so it is freed after the context.
    _activations: CudaSlice<u8>,
}

impl TrtModel {
    /// A new context of `engine` (one per replica; the engine is shared by the GPU's
    /// replicas) for `inputs`, each `[1, C, H, W]` as the pipeline description says, and
    /// the output `output`, float32 or float16 and `[1, C, H, W]`; every other output
    /// gets a scratch buffer. The GPU must be current on this thread.
    pub fn new(
        stream: &Arc<CudaStream>,
        engine: &Arc<Engine>,
        label: &str,
        inputs: &[(&str, [usize; 4])],
        output: &str,
    ) -> Result<Self, CudaError> {
        let mismatch = |reason: String| CudaError::Stage {
            stage: "model",
            reason: format!("{label}: {reason}"),
        };
        let find = |name: &str, is_input: bool| -> Result<&TensorDesc, CudaError> {
            engine
                .io_tensors()
                .iter()
                .find(|t| t.name == name && t.is_input == is_input)
                .ok_or_else(|| {
                    let names: Vec<&str> = engine
                        .io_tensors()
                        .iter()
                        .filter(|t| t.is_input == is_input)
                        .map(|t| t.name.as_str())
                        .collect();
                    mismatch(format!(
                        "the engine has no {} `{name}` (it has {}); celer.toml names it",
                        if is_input { "input" } else { "output" },
                        names.join(", ")
                    ))
                })
        };
        let bytes = engine.device_memory_bytes()?;
        let activations: CudaSlice<u8> =
            stream.alloc_zeros(usize::try_from(bytes.max(1)).unwrap_or(usize::MAX))?;
        let memory = activations.device_ptr(stream).0;
        // SAFETY: `activations` holds the engine's device memory size for one context,
        // lives in this struct next to the context and is freed after it (field order);
        // only this context uses it, on the replica's stream.
        let mut context = unsafe {
            engine.create_context_with_memory(DevicePtr::from_raw(memory as *mut c_void), bytes)
        }?;
        let mut bound = Vec::with_capacity(inputs.len());
        for &(name, shape) in inputs {
            let desc = find(name, true)?;
            let element = match desc.data_type {
                DataType::Float => InputElement::F32,
                DataType::Half => InputElement::F16,
                other => {
                    return Err(mismatch(format!(
                        "input `{name}` is {other}; celer's preprocessing writes float32 or float16"
                    )))
                }
            };
            let wanted: Vec<i64> = shape.iter().map(|&d| d as i64).collect();
            let fits = desc.shape.len() == wanted.len()
                && desc
                    .shape
                    .iter()
                    .zip(&wanted)
                    .all(|(&have, &want)| have < 0 || have == want);
            if !fits {
                return Err(mismatch(format!(
                    "input `{name}` has shape {:?}, the pipeline feeds {wanted:?}",
                    desc.shape
                )));
            }
            if desc.shape.iter().any(|&d| d < 0) {
                context.set_input_shape(name, &wanted)?;
            }
            bound.push((name.to_string(), element, shape.iter().product()));
        }
        if let Some(extra) = engine
            .inputs()
            .find(|t| !inputs.iter().any(|(name, _)| *name == t.name))
        {
            return Err(mismatch(format!(
                "the engine takes an input `{}` that celer.toml does not feed",
                extra.name
            )));
        }
        let desc = find(output, false)?;
        let half = match desc.data_type {
            DataType::Float => false,
            DataType::Half => true,
            other => {
                return Err(mismatch(format!(
                    "output `{output}` is {other}; celer's trimap and matting kernels read \
                     float32 or float16"
                )))
            }
        };
        let shape = context.tensor_shape(output)?;
        let output_shape = match shape.as_slice() {
            &[1, c, h, w] if c >= 1 && h >= 1 && w >= 1 => [1, c as usize, h as usize, w as usize],
            other => {
                return Err(mismatch(format!(
                    "output `{output}` has shape {other:?} for one image; expected [1, C, H, W]"
                )))
            }
        };
        let half_output = if half {
            Some(stream.alloc_zeros::<f16>(output_shape.iter().product())?)
        } else {
            None
        };
        let mut unread = Vec::new();
        for desc in engine.outputs().filter(|t| t.name != output) {
            let elements: i64 = context.tensor_shape(&desc.name)?.iter().product();
            let bytes =
                usize::try_from(elements.max(1)).unwrap_or(1) * element_bytes(desc.data_type);
            let scratch: CudaSlice<u8> = stream.alloc_zeros(bytes)?;
            let address = scratch.device_ptr(stream).0;
            // SAFETY: the scratch buffer holds the whole output (its shape times its
            // element size) and lives in this struct, next to the context, so it stays
            // allocated as long as any enqueue can write it.
            unsafe {
                context
                    .set_tensor_address(&desc.name, DevicePtr::from_raw(address as *mut c_void))?;
            }
            unread.push(scratch);
        }
        Ok(Self {
            context,
            label: label.to_string(),
            inputs: bound,
            output: output.to_string(),
            output_shape,
            bound: false,
            half_output,
            _unread_outputs: unread,
            _activations: activations,
        })
    }

    pub fn output_shape(&self) -> [usize; 4] {
        self.output_shape
    }

    fn input_element(&self, name: &str) -> Result<InputElement, CudaError> {
        self.inputs
            .iter()
            .find(|(n, ..)| n == name)
            .map(|&(_, e, _)| e)
            .ok_or_else(|| CudaError::Stage {
                stage: "model",
                reason: format!("{}: no input `{name}` was set up", self.label),
            })
    }

    /// Binds `inputs` (by name) and `output` to the engine's tensors, once: the buffers
    /// are allocated at start-up and never move, and TensorRT keeps addresses between
    /// enqueues, so the request path binds nothing.
    ///
    /// # Safety
    /// Every buffer must stay allocated, and be written by nothing else while an enqueue
    /// is in flight, for as long as this model is enqueued: the owner (`GpuPipeline`)
    /// holds them next to it, drops the model first, and synchronises its stream before
    /// it writes an input or reads the output.
    pub unsafe fn bind(
        &mut self,
        stream: &Arc<CudaStream>,
        inputs: &[(&str, &DeviceTensor)],
        output: &CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        if inputs.len() != self.inputs.len() {
            return Err(CudaError::Stage {
                stage: "model",
                reason: format!(
                    "{}: {} inputs given, the engine takes {}",
                    self.label,
                    inputs.len(),
                    self.inputs.len()
                ),
            });
        }
        for &(name, buffer) in inputs {
            let element = self.input_element(name)?;
            let len = self
                .inputs
                .iter()
                .find(|(n, ..)| n == name)
                .map_or(0, |&(_, _, len)| len);
            let matches = matches!(
                (element, buffer),
                (InputElement::F32, DeviceTensor::F32(_))
                    | (InputElement::F16, DeviceTensor::F16(_))
            );
            if !matches || buffer.len() < len {
                return Err(CudaError::BufferTooSmall {
                    what: "engine input",
                    needed: len,
                    capacity: if matches { buffer.len() } else { 0 },
                });
            }
            let address = buffer.address(stream);
            // SAFETY: the buffer holds at least the input's elements in the engine's
            // element type (checked just above); its lifetime is the caller's contract.
            unsafe {
                self.context
                    .set_tensor_address(name, DevicePtr::from_raw(address as *mut c_void))?;
            }
        }
        let out_len: usize = self.output_shape.iter().product();
        if output.len() < out_len {
            return Err(CudaError::BufferTooSmall {
                what: "engine output",
                needed: out_len,
                capacity: output.len(),
            });
        }
        let address = match &self.half_output {
            Some(half) => half.device_ptr(stream).0,
            None => output.device_ptr(stream).0,
        };
        // SAFETY: the output buffer (the f32 one, or this model's float16 scratch of the
        // output's size) holds the output's elements; its lifetime is the caller's
        // contract (the scratch's is this struct's).
        unsafe {
            self.context
                .set_tensor_address(&self.output, DevicePtr::from_raw(address as *mut c_void))?;
        }
        self.bound = true;
        Ok(())
    }

    /// Enqueues the engine on the launcher's stream (then, for a float16 output, its
    /// conversion into `output`, the f32 buffer given to `bind`). Returns once the work
    /// is queued; `output` is written when the stream reaches it.
    pub fn enqueue(
        &mut self,
        launcher: &Launcher<'_>,
        output: &mut CudaSlice<f32>,
    ) -> Result<(), CudaError> {
        if !self.bound {
            return Err(CudaError::Stage {
                stage: "model",
                reason: format!("{}: enqueued before its buffers were bound", self.label),
            });
        }
        // SAFETY: every I/O tensor is bound (`bind` matched all the engine's inputs and
        // the output, unread outputs were bound at construction) and dynamic shapes were
        // set then. The stream is the replica's, of the context current on this thread,
        // and lives as long as the GpuPipeline, which synchronises it before reading the
        // output.
        unsafe {
            let raw = TrtStream::from_raw(launcher.stream.cu_stream() as *mut c_void);
            self.context.enqueue(raw)?;
        }
        if let Some(half) = &self.half_output {
            launcher.f16_to_f32(half, self.output_shape.iter().product(), output)?;
        }
        Ok(())
    }
}

/// Bytes per element of a TensorRT type (sub-byte types rounded up: a bound buffer may
/// be larger than needed, never smaller).
fn element_bytes(t: DataType) -> usize {
    match t {
        DataType::Int64 => 8,
        DataType::Float | DataType::Int32 => 4,
        DataType::Half | DataType::Bf16 => 2,
        _ => 1,
    }
}

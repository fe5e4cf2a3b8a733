//! A TensorRT engine's execution context and everything it reads and writes on the device:
//! its input tensors (written by the preprocessing kernels), its float32 output (read by
//! the trimap and matting kernels; a float16 output is converted into it by a kernel),
//! scratch for the outputs nobody reads, and its activation memory. Every address is bound
//! once, in `new`, to buffers this type owns and never reallocates, so an enqueue cannot
//! reach freed or moved memory and there is no bind step to forget (an engine with an
//! output of data-dependent shape, which no buffer sized at load can hold, is refused
//! there). Enqueued on the replica's stream between the kernels: nothing crosses the bus.

use std::ffi::c_void;
use std::sync::Arc;

use super::driver::{CudaSlice, CudaStream, DriverError};
use half::f16;

use super::launch::{Launcher, ModelInput};
use super::tensor::{GpuTensor, TensorElement};
use super::trt_context;
use super::CudaError;
use crate::tensorrt::{
    CudaStream as TrtStream, DataType, DevicePtr, Engine, ExecutionContext, TrtError,
};

/// Why a TensorRT model failed: TensorRT itself (a context, a binding, an enqueue), the
/// CUDA work around it (its buffers, the float16 conversion; an enqueue that found the
/// context lost), or an engine celer's pipeline cannot run. Kept apart, so that a lost
/// context is still told by `CudaError::is_device_lost`.
#[derive(Debug, thiserror::Error)]
pub enum TrtModelError {
    #[error(transparent)]
    Cuda(#[from] CudaError),
    #[error(transparent)]
    TensorRt(#[from] TrtError),
    /// An output whose shape TensorRT knows only when the engine runs (-1 after every
    /// input shape is set: NonZero's count, say).
    #[error(
        "{model}: output `{output}` has a data-dependent shape {shape:?}: TensorRT learns \
         its size only when the engine runs (it would need an output allocator), and celer \
         binds every output to a buffer sized when the model loads, so engines with \
         data-dependent output shapes are not supported; export the model without that \
         output, or with a fixed size"
    )]
    DataDependentOutput {
        model: String,
        output: String,
        shape: Vec<i64>,
    },
}

impl From<DriverError> for TrtModelError {
    fn from(error: DriverError) -> Self {
        Self::Cuda(error.into())
    }
}

/// One input of an engine as the pipeline feeds it, already checked against the engine
/// (the replica layer's model contract).
#[derive(Debug, Clone, Copy)]
pub struct TrtInput<'a> {
    pub name: &'a str,
    /// `[1, C, H, W]`.
    pub shape: [usize; 4],
    pub element: TensorElement,
    /// The engine's shape has a dynamic dimension: the context is given `shape`.
    pub dynamic: bool,
}

/// An engine's execution context for one image per enqueue, with its buffers. One per
/// replica; the engine is shared by the GPU's replicas.
pub struct TrtModel {
    /// Declared first, so that it goes before the buffers it reads and writes (after
    /// `drop` has let its last enqueue finish).
    context: ExecutionContext,
    stream: Arc<CudaStream>,
    label: String,
    inputs: Vec<GpuTensor>,
    output: CudaSlice<f32>,
    output_shape: [usize; 4],
    /// Where a float16 output is written before `f16_to_f32` makes it `output`.
    half_output: Option<CudaSlice<f16>>,
    /// Outputs the pipeline does not read (U2Net's side outputs): TensorRT writes every
    /// output, so each gets a buffer.
    _unread_outputs: Vec<CudaSlice<u8>>,
    /// The context's activation memory, from the device's memory pool.
    _activations: CudaSlice<u8>,
}

impl Drop for TrtModel {
    fn drop(&mut self) {
        // An enqueue still in flight uses the context and every buffer here: let it end.
        // (The buffers' frees are stream-ordered anyway; the context's destruction is not.)
        let _ = self.stream.synchronize();
    }
}

impl TrtModel {
    /// A new context of `engine` on `stream` for `inputs` (in the pipeline's order) and
    /// the output `output` (`half`: the engine writes float16), which must be `[1, C, H,
    /// W]` for one image; every other output gets a scratch buffer. The GPU must be
    /// current on this thread.
    pub fn new(
        stream: &Arc<CudaStream>,
        engine: &Arc<Engine>,
        label: &str,
        inputs: &[TrtInput<'_>],
        output: &str,
        half: bool,
    ) -> Result<Self, TrtModelError> {
        let mismatch = |reason: String| CudaError::Stage {
            stage: "model",
            reason: format!("{label}: {reason}"),
        };
        let bytes = engine.device_memory_bytes()?;
        let activations: CudaSlice<u8> =
            stream.alloc_zeros(usize::try_from(bytes.max(1)).unwrap_or(usize::MAX))?;
        let memory = activations.device_ptr();
        // SAFETY: `activations` holds the engine's device memory size for one context and
        // is owned by the model with the context, which `drop` lets finish first; only
        // this context uses it, on this stream.
        let mut context = unsafe {
            engine.create_context_with_memory(DevicePtr::from_raw(memory as *mut c_void), bytes)
        }?;
        for input in inputs.iter().filter(|i| i.dynamic) {
            let shape: Vec<i64> = input.shape.iter().map(|&d| d as i64).collect();
            context.set_input_shape(input.name, &shape)?;
        }
        refuse_data_dependent(&context, label)?;
        let mut tensors = Vec::with_capacity(inputs.len());
        for input in inputs {
            let tensor = GpuTensor::alloc(stream, input.element, input.shape.iter().product())?;
            // SAFETY: the tensor holds the input's elements in the engine's element type
            // (the contract checked the type; its length is the shape's) and is owned by
            // the model with the context.
            unsafe { bind(&mut context, input.name, tensor.address())? };
            tensors.push(tensor);
        }
        let output_shape = match context.tensor_shape(output)?.as_slice() {
            &[1, c, h, w] if c >= 1 && h >= 1 && w >= 1 => [1, c as usize, h as usize, w as usize],
            other => {
                return Err(mismatch(format!(
                    "output `{output}` has shape {other:?} for one image; expected [1, C, H, W]"
                ))
                .into())
            }
        };
        let elements: usize = output_shape.iter().product();
        let output_f32: CudaSlice<f32> = stream.alloc_zeros(elements)?;
        let half_output = if half {
            Some(stream.alloc_zeros::<f16>(elements)?)
        } else {
            None
        };
        let written = match &half_output {
            Some(h) => h.device_ptr(),
            None => output_f32.device_ptr(),
        };
        // SAFETY: the buffer holds the output's elements in its element type and is owned
        // by the model with the context.
        unsafe { bind(&mut context, output, written)? };
        let mut unread = Vec::new();
        for desc in engine.outputs().filter(|t| t.name != output) {
            let count: i64 = context.tensor_shape(&desc.name)?.iter().product();
            let bytes = usize::try_from(count.max(1)).unwrap_or(1) * element_bytes(desc.data_type);
            let scratch: CudaSlice<u8> = stream.alloc_zeros(bytes)?;
            // SAFETY: the scratch holds the whole output (its shape times its element
            // size) and is owned by the model with the context.
            unsafe { bind(&mut context, &desc.name, scratch.device_ptr())? };
            unread.push(scratch);
        }
        Ok(Self {
            context,
            stream: stream.clone(),
            label: label.to_string(),
            inputs: tensors,
            output: output_f32,
            output_shape,
            half_output,
            _unread_outputs: unread,
            _activations: activations,
        })
    }

    pub fn label(&self) -> &str {
        &self.label
    }

    /// Where the preprocessing writes input `index` (in the order given to `new`).
    pub fn input(&mut self, index: usize) -> Result<ModelInput<'_>, CudaError> {
        let label = &self.label;
        self.inputs
            .get_mut(index)
            .map(GpuTensor::as_model_input)
            .ok_or_else(|| CudaError::Stage {
                stage: "model",
                reason: format!("{label} has no input {index}"),
            })
    }

    /// The output as float32, valid once the stream has run the last `enqueue`.
    pub fn output(&self) -> &CudaSlice<f32> {
        &self.output
    }

    pub fn output_shape(&self) -> [usize; 4] {
        self.output_shape
    }

    /// Enqueues the engine on the model's stream (then, for a float16 output, its
    /// conversion into `output`). Returns once the work is queued.
    pub fn enqueue(&mut self, launcher: &Launcher<'_>) -> Result<(), TrtModelError> {
        if !Arc::ptr_eq(launcher.stream, &self.stream) {
            return Err(CudaError::Stage {
                stage: "model",
                reason: format!("{}: enqueued on another stream than its own", self.label),
            }
            .into());
        }
        // SAFETY: every I/O tensor was bound in `new` to a buffer this model owns, and
        // dynamic shapes were set then; the stream is the model's own, of the context
        // current on this thread, and `drop` waits for it before anything is freed.
        let enqueued = unsafe {
            let raw = TrtStream::from_raw(self.stream.cu_stream() as *mut c_void);
            self.context.enqueue(raw)
        };
        if let Err(refused) = enqueued {
            return Err(self.enqueue_failed(refused));
        }
        if let Some(half) = &self.half_output {
            launcher.f16_to_f32(half, self.output_shape.iter().product(), &mut self.output)?;
        }
        Ok(())
    }

    /// An enqueue TensorRT refused: that request's failure, unless the context's error is
    /// sticky (a kernel TensorRT launched met an illegal address, or the context was lost
    /// before): then the GPU's, told as the driver's error, so that the device is known
    /// lost at once (`CudaError::is_device_lost`) rather than at the next request's
    /// synchronisation.
    fn enqueue_failed(&self, refused: TrtError) -> TrtModelError {
        match trt_context::sticky_error(&self.stream) {
            Some(error) => CudaError::Driver {
                error,
                context: format!(
                    "{}: enqueueV3 failed ({refused}), and the GPU's context is lost: ",
                    self.label
                ),
            }
            .into(),
            None => refused.into(),
        }
    }
}

/// Refuses an engine with an output of data-dependent shape: once every input's shape is
/// set, each output's must be known, so that a buffer can be sized for it.
fn refuse_data_dependent(context: &ExecutionContext, label: &str) -> Result<(), TrtModelError> {
    for desc in context.engine().outputs() {
        let shape = context.tensor_shape(&desc.name)?;
        if shape.iter().any(|&d| d < 0) {
            return Err(TrtModelError::DataDependentOutput {
                model: label.to_string(),
                output: desc.name.clone(),
                shape,
            });
        }
    }
    Ok(())
}

/// Binds tensor `name` of `context` to device address `address`.
///
/// # Safety
/// `address` must hold the tensor's whole size in its element type, and stay allocated
/// and unmoved while the context can be enqueued.
unsafe fn bind(context: &mut ExecutionContext, name: &str, address: u64) -> Result<(), TrtError> {
    // SAFETY: forwarded to the caller.
    unsafe { context.set_tensor_address(name, DevicePtr::from_raw(address as *mut c_void))? };
    Ok(())
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

//! One model of a GPU replica, whatever runs it: a TensorRT engine on the replica's
//! stream (inputs and output stay on the device), or, where TensorRT is absent, ONNX
//! Runtime on the CPU (inputs downloaded, output uploaded: one synchronisation per model).
//! Either way the model owns its input tensors, which the kernels write, and its float32
//! output, which the kernels read; both kinds are checked against the model's contract
//! when they load, and both learn the output's shape then.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cuda::driver::{CudaSlice, CudaStream, PinnedHostSlice};

use super::error::GpuError;
use crate::cuda::launch::{Launcher, ModelInput};
use crate::cuda::tensor::TensorElement;
use crate::cuda::trt_model::{TrtInput, TrtModel};
use crate::cuda::{CudaError, GpuDevice};
use crate::engines::manifest::model_name;
use crate::ort::session::OrtModel;
use crate::replica::contract::{Declared, Element};
use crate::replica::models::ModelSpec;
use crate::tensorrt::{DataType, Engine};

/// A model run on the host: when its inputs had come down, and how long it ran.
#[derive(Debug, Clone, Copy)]
pub struct HostRun {
    pub inputs_ready: Instant,
    pub model: Duration,
}

/// What runs a GPU replica's models.
pub enum ModelSource<'a> {
    /// ONNX Runtime on the CPU, `intra_threads` threads per model: where TensorRT is
    /// absent.
    OnnxRuntime { intra_threads: usize },
    /// The GPU's engines, deserialised once per GPU; each replica makes its own
    /// execution contexts. `matting` is needed when the pipeline has a matting model.
    TensorRt {
        segmentation: &'a Arc<Engine>,
        matting: Option<&'a Arc<Engine>>,
    },
}

impl ModelSource<'_> {
    /// "TensorRT" or "ONNX Runtime (CPU)", for logs.
    pub fn describe(&self) -> &'static str {
        match self {
            Self::OnnxRuntime { .. } => "ONNX Runtime (CPU)",
            Self::TensorRt { .. } => "TensorRT",
        }
    }
}

/// What an engine may take and give here: the preprocessing writes float32 or float16,
/// and a float16 output is converted by a kernel.
const ENGINE_ELEMENTS: &[Element] = &[Element::F32, Element::F16];

/// One model of one GPU replica.
pub enum GpuModel {
    TensorRt(TrtModel),
    /// Where TensorRT is absent: ONNX Runtime on the CPU.
    OnnxRuntime(OrtOnGpu),
}

/// An ONNX Runtime session fed from and feeding device buffers.
pub struct OrtOnGpu {
    model: OrtModel,
    output_name: String,
    inputs: Vec<OrtInput>,
    output: CudaSlice<f32>,
    output_shape: [usize; 4],
}

/// One input of an ONNX Runtime model on a GPU replica.
struct OrtInput {
    name: String,
    shape: [usize; 4],
    /// What the kernels write.
    tensor: CudaSlice<f32>,
    /// Where it comes down to for the session.
    staging: PinnedHostSlice<f32>,
}

impl GpuModel {
    /// The model of `spec`, from `engine` when given, else ONNX Runtime on its file, with
    /// its buffers on `stream`.
    pub fn load(
        spec: &ModelSpec<'_>,
        engine: Option<&Arc<Engine>>,
        intra_threads: usize,
        device: &GpuDevice,
        stream: &Arc<CudaStream>,
    ) -> Result<Self, GpuError> {
        match engine {
            Some(engine) => Ok(Self::TensorRt(load_engine(spec, engine, stream)?)),
            None => Ok(Self::OnnxRuntime(OrtOnGpu::load(
                spec,
                intra_threads,
                device,
                stream,
            )?)),
        }
    }

    pub fn label(&self) -> &str {
        match self {
            Self::TensorRt(m) => m.label(),
            Self::OnnxRuntime(m) => m.model.label(),
        }
    }

    /// Whether the model runs on the GPU (its time then comes from the stream's events).
    pub fn on_gpu(&self) -> bool {
        matches!(self, Self::TensorRt(_))
    }

    /// Where the kernels write input `index` (the contract's order).
    pub fn input(&mut self, index: usize) -> Result<ModelInput<'_>, GpuError> {
        match self {
            Self::TensorRt(m) => Ok(m.input(index)?),
            Self::OnnxRuntime(m) => {
                let label = m.model.label().to_string();
                m.inputs
                    .get_mut(index)
                    .map(|input| ModelInput::F32(&mut input.tensor))
                    .ok_or_else(|| stage(format!("{label} has no input {index}")))
            }
        }
    }

    /// The output as float32 on the device, valid once the stream has run the model.
    pub fn output(&self) -> &CudaSlice<f32> {
        match self {
            Self::TensorRt(m) => m.output(),
            Self::OnnxRuntime(m) => &m.output,
        }
    }

    /// `[1, C, H, W]` of the output.
    pub fn output_shape(&self) -> [usize; 4] {
        match self {
            Self::TensorRt(m) => m.output_shape(),
            Self::OnnxRuntime(m) => m.output_shape,
        }
    }

    /// Runs the model on its inputs as the stream will hold them. TensorRT: queued on the
    /// stream, `None`. ONNX Runtime: waits for the stream, runs on the CPU, queues the
    /// output's upload, and says when the inputs were down and how long the model took.
    pub fn run(&mut self, launcher: &Launcher<'_>) -> Result<Option<HostRun>, GpuError> {
        match self {
            Self::TensorRt(m) => {
                m.enqueue(launcher)?;
                Ok(None)
            }
            Self::OnnxRuntime(m) => m.run(launcher.stream).map(Some),
        }
    }
}

fn stage(reason: String) -> GpuError {
    GpuError::Cuda(CudaError::Stage {
        stage: "model",
        reason,
    })
}

/// An execution context of `engine` for `spec`, after checking the engine against the
/// model's contract.
fn load_engine(
    spec: &ModelSpec<'_>,
    engine: &Arc<Engine>,
    stream: &Arc<CudaStream>,
) -> Result<TrtModel, GpuError> {
    let label = format!("{} (TensorRT)", model_name(spec.path));
    let declared: Vec<Declared> = engine
        .io_tensors()
        .iter()
        .map(|t| Declared {
            name: t.name.clone(),
            is_input: t.is_input,
            element: match t.data_type {
                DataType::Float => Element::F32,
                DataType::Half => Element::F16,
                other => Element::Other(other.to_string()),
            },
            shape: t.shape.clone(),
        })
        .collect();
    let agreed = spec
        .contract(&label, ENGINE_ELEMENTS)
        .check(&declared)
        .map_err(|e| GpuError::Model(e.into()))?;
    let inputs: Vec<TrtInput<'_>> = spec
        .inputs
        .iter()
        .zip(&agreed.inputs)
        .map(|(&(name, shape), (element, dynamic))| TrtInput {
            name,
            shape,
            element: if *element == Element::F16 {
                TensorElement::F16
            } else {
                TensorElement::F32
            },
            dynamic: *dynamic,
        })
        .collect();
    let half = agreed.output == Element::F16;
    Ok(TrtModel::new(
        stream,
        engine,
        &label,
        &inputs,
        spec.output,
        half,
    )?)
}

impl OrtOnGpu {
    /// The session, checked against its contract, its device buffers and staging, and
    /// the output's shape from one warm-up run on zeros.
    fn load(
        spec: &ModelSpec<'_>,
        intra_threads: usize,
        device: &GpuDevice,
        stream: &Arc<CudaStream>,
    ) -> Result<Self, GpuError> {
        let mut model = spec.load_ort(intra_threads)?;
        let zeros: Vec<Vec<f32>> = spec
            .inputs
            .iter()
            .map(|(_, shape)| vec![0f32; shape.iter().product()])
            .collect();
        let feed: Vec<(&str, [usize; 4], &[f32])> = spec
            .inputs
            .iter()
            .zip(&zeros)
            .map(|(&(name, shape), data)| (name, shape, data.as_slice()))
            .collect();
        let warm = model.run(&feed, spec.output)?;
        let output_shape = match warm.shape.as_slice() {
            &[1, c, h, w] if c >= 1 && warm.data.len() == c * h * w => [1, c, h, w],
            shape => {
                return Err(stage(format!(
                    "{}: expected an output of shape [1, C, H, W], got {shape:?}",
                    model.label()
                )))
            }
        };
        let mut inputs = Vec::with_capacity(spec.inputs.len());
        for &(name, shape) in &spec.inputs {
            let len: usize = shape.iter().product();
            inputs.push(OrtInput {
                name: name.to_string(),
                shape,
                tensor: stream.alloc_zeros::<f32>(len)?,
                staging: crate::cuda::pinned::<f32>(device.context(), len, false)?,
            });
        }
        Ok(Self {
            output_name: spec.output.to_string(),
            output: stream.alloc_zeros(output_shape.iter().product())?,
            output_shape,
            inputs,
            model,
        })
    }

    /// Downloads the inputs, waits for them, runs the session and queues the output's
    /// upload.
    fn run(&mut self, stream: &Arc<CudaStream>) -> Result<HostRun, GpuError> {
        for input in self.inputs.iter_mut() {
            let len = input.tensor.len();
            let host = &mut input.staging.as_mut_slice()[..len];
            stream.memcpy_dtoh(&input.tensor, host)?;
        }
        stream.synchronize()?;
        let inputs_ready = Instant::now();
        let mut feed = Vec::with_capacity(self.inputs.len());
        for input in &self.inputs {
            let host = &input.staging.as_slice()[..input.tensor.len()];
            feed.push((input.name.as_str(), input.shape, host));
        }
        let out = self.model.run(&feed, &self.output_name)?;
        let expected: usize = self.output_shape.iter().product();
        if out.shape.as_slice() != self.output_shape || out.data.len() != expected {
            return Err(stage(format!(
                "{}: output shape {:?} differs from {:?} seen at start-up (the GPU buffers are sized for it)",
                self.model.label(),
                out.shape,
                self.output_shape
            )));
        }
        stream.memcpy_htod(&out.data, &mut self.output)?;
        Ok(HostRun {
            inputs_ready,
            model: inputs_ready.elapsed(),
        })
    }
}

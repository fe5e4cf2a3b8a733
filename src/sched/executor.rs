//! What one replica runs: the `Executor` trait that the router, the workers and the
//! batcher are generic over, and its implementation for the real pipeline. An executor
//! belongs to one replica thread and is never shared, so it needs no lock.

use std::sync::Arc;

use image::{RgbImage, RgbaImage};

use super::device::Device;
use super::router::{DeviceSetup, LoadFn};
use crate::config::PipelineSpec;
use crate::pipeline::{Matte, Pipeline, StageTimings};

/// An executor's failure, kept as the error it was (logged, never sent to a client).
pub type ExecError = Box<dyn std::error::Error + Send + Sync>;

pub trait Executor: Send + 'static {
    /// One request's input. Cloned once when a request fails over to another device.
    type Input: Clone + Send + Sync + 'static;
    type Output: Send + 'static;

    /// Runs `inputs` as one batch (often of one) and returns one output per input, in
    /// order.
    fn run_batch(&mut self, inputs: &[&Self::Input]) -> Result<Vec<Self::Output>, ExecError>;

    /// A small inference whose success shows that an unhealthy device works again.
    fn probe(&mut self) -> Result<(), ExecError>;

    /// Whether `error`, from a run or a probe of this executor, means that its device is
    /// lost (a GPU whose context failed for every replica on it): retrying is pointless
    /// until the device is recovered.
    fn device_lost(&self, _error: &ExecError) -> bool {
        false
    }

    /// Brings a lost device back (reopen it, reload the models), on this replica's
    /// thread, while the router sends the device nothing. A passing probe then returns it
    /// to service; a failed recovery is tried again at the next failed probe.
    fn recover(&mut self) -> Result<(), ExecError> {
        Ok(())
    }
}

impl<E: Executor + ?Sized> Executor for Box<E> {
    type Input = E::Input;
    type Output = E::Output;

    fn run_batch(&mut self, inputs: &[&Self::Input]) -> Result<Vec<Self::Output>, ExecError> {
        (**self).run_batch(inputs)
    }

    fn probe(&mut self) -> Result<(), ExecError> {
        (**self).probe()
    }

    fn device_lost(&self, error: &ExecError) -> bool {
        (**self).device_lost(error)
    }

    fn recover(&mut self) -> Result<(), ExecError> {
        (**self).recover()
    }
}

/// The device stages' input: a decoded image and the times of the stages before.
#[derive(Debug, Clone)]
pub struct PipelineJob {
    pub image: Arc<RgbImage>,
    pub timings: StageTimings,
    /// The response is the RGBA cut-out: a device that composites (a GPU) makes it
    /// before its one download. The CPU leaves it to `render`.
    pub want_cutout: bool,
}

#[derive(Debug)]
pub struct PipelineOutput {
    pub matte: Matte,
    /// The cut-out, when the device made it.
    pub cutout: Option<RgbaImage>,
    pub timings: StageTimings,
}

/// Any executor of the pipeline's stages: the ONNX Runtime pipeline on the CPU, the GPU
/// pipeline (`gpu::GpuExecutor`), a stand-in in tests.
pub type BoxedPipelineExecutor = Box<dyn Executor<Input = PipelineJob, Output = PipelineOutput>>;

/// One replica of the real pipeline.
pub struct PipelineExecutor {
    pipeline: Pipeline,
    probe_image: RgbImage,
}

impl PipelineExecutor {
    pub fn new(pipeline: Pipeline) -> Self {
        Self {
            pipeline,
            probe_image: probe_image(),
        }
    }
}

/// The image a health probe runs: small and not uniform, so every stage (min-max,
/// trimap, matting) has work.
pub(super) fn probe_image() -> RgbImage {
    RgbImage::from_fn(32, 32, |x, y| {
        let v = if (8..24).contains(&x) && (8..24).contains(&y) {
            220
        } else {
            30
        };
        image::Rgb([v, v, v])
    })
}

impl Executor for PipelineExecutor {
    type Input = PipelineJob;
    type Output = PipelineOutput;

    fn run_batch(&mut self, inputs: &[&PipelineJob]) -> Result<Vec<PipelineOutput>, ExecError> {
        let images: Vec<&RgbImage> = inputs.iter().map(|j| j.image.as_ref()).collect();
        let mut timings: Vec<StageTimings> = inputs.iter().map(|j| j.timings).collect();
        let mattes = self.pipeline.run_batch(&images, &mut timings)?;
        Ok(mattes
            .into_iter()
            .zip(timings)
            .map(|(matte, timings)| PipelineOutput {
                matte,
                cutout: None,
                timings,
            })
            .collect())
    }

    fn probe(&mut self) -> Result<(), ExecError> {
        self.pipeline
            .run(&self.probe_image, &mut StageTimings::default())
            .map(|_| ())
            .map_err(Into::into)
    }
}

/// The CPU as a device of `celer serve` or `celer run` for `spec`: `replicas` replicas,
/// each with its own sessions and `threads` ONNX Runtime threads. (GPUs: `gpu`.)
pub fn cpu_device_setup(
    spec: &PipelineSpec,
    replicas: usize,
    threads: usize,
) -> DeviceSetup<BoxedPipelineExecutor> {
    let batching = spec.batching;
    let spec = spec.clone();
    let load: LoadFn<BoxedPipelineExecutor> = Arc::new(move |_replica| {
        let pipeline = Pipeline::load(&spec, threads)?;
        Ok(Box::new(PipelineExecutor::new(pipeline)) as BoxedPipelineExecutor)
    });
    DeviceSetup {
        name: Device::Cpu.to_string(),
        replicas,
        batching,
        load,
    }
}

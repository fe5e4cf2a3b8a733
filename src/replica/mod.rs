//! The replica layer: what one replica of a device runs, between the scheduler (queues,
//! routing, health; never pixels) and the compute libraries (ONNX Runtime, CUDA,
//! TensorRT). It owns the `Executor` implementations for the CPU (`cpu`) and the GPU
//! (`gpu`), and the model contract that ONNX Runtime and TensorRT models are both checked
//! against (`contract`). Decoding and encoding are `crate::codec`'s; the CPU stages are
//! `crate::stages`'s. See docs/architecture.md.

pub mod contract;
pub mod cores;
pub mod cpu;
pub mod gpu;
pub mod models;

use std::sync::Arc;
use std::time::Instant;

use image::RgbImage;

use crate::matte::{MattePlanes, Planes, StageTimings};
use crate::pixels::{self, RgbPixels};
use crate::sched::{Executor, RunParts, Scheduler, SubmitError, Terms, Ticket, Work};

/// The device stages' input: a decoded image (in the host block its decoder wrote, which
/// a GPU uploads from), the times of the stages before, and the planes the answer shows
/// (decided once, from what the client asked for).
#[derive(Debug, Clone)]
pub struct MatteJob {
    pub image: Arc<RgbPixels>,
    pub timings: StageTimings,
    /// What to hand back. A cut-out is made by the device (the GPU before its one
    /// download, the CPU on its replica), so that rendering only encodes.
    pub planes: Planes,
}

impl MatteJob {
    pub fn new(image: Arc<RgbPixels>, timings: StageTimings, planes: Planes) -> Self {
        Self {
            image,
            timings,
            planes,
        }
    }

    /// What it asks of a device, as the cost model prices it: its pixels, and whether a
    /// cut-out is composited.
    pub fn work(&self) -> Work {
        Work::of_image(self.image.width(), self.image.height(), self.planes.cutout)
    }
}

#[derive(Debug)]
pub struct MatteOutput {
    /// At least the planes the job asked for.
    pub planes: MattePlanes,
    pub timings: StageTimings,
}

impl MatteOutput {
    /// What the device's cost model learns from this run: the segmentation model's stage
    /// is the fixed part (it runs at its input size whatever the image's), the cut-out's
    /// composite its own; the rest (resampling, trimap, matting at the source size)
    /// grows with the pixels. A matting model's run is counted with the rest: its stage
    /// also resizes its alpha to the source size, and most pipelines refine with the
    /// guided filter.
    pub fn run_parts(&self) -> RunParts {
        RunParts {
            fixed: self.timings.model,
            composite: self.timings.composite,
        }
    }
}

/// Any executor of the pipeline's stages: the CPU's (`cpu::CpuExecutor`), a GPU's
/// (`gpu::GpuExecutor`), a stand-in in tests.
pub type BoxedMatteExecutor = Box<dyn Executor<Input = MatteJob, Output = MatteOutput>>;

/// The scheduler `celer serve` and `celer run` use: the real pipeline on every device.
pub type MatteScheduler = Scheduler<BoxedMatteExecutor>;

impl MatteScheduler {
    /// Admits `job` priced by its pixels (`MatteJob::work`), to finish by `deadline`, at
    /// the default priority, and queues it, or refuses at once (`Scheduler::submit`).
    /// `Scheduler::submit` prices a request of no particular size at the mean of the
    /// runs so far: a 12 MP photo after small ones then reads as a device gone many times
    /// slower than its prices, and a folder of mixed sizes is routed by count.
    pub fn submit_priced(
        &self,
        job: MatteJob,
        deadline: Instant,
    ) -> Result<Ticket<BoxedMatteExecutor>, SubmitError> {
        let terms = Terms::by(deadline).with_work(job.work());
        self.submit_admitted(self.admit()?, job, terms)
    }
}

/// The image a health check runs: small and not uniform, so every stage (min-max,
/// trimap, matting) has work.
pub(crate) fn health_check_image() -> RgbImage {
    RgbImage::from_fn(32, 32, |x, y| {
        let v = if (8..24).contains(&x) && (8..24).contains(&y) {
            220
        } else {
            30
        };
        image::Rgb([v, v, v])
    })
}

/// A `w` x `h` image for a warm-up: the health check's (a bright square on a dark ground)
/// at that size, so that every stage has work.
pub(crate) fn warmup_image(w: u32, h: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        let inside = (w / 4..w - w / 4).contains(&x) && (h / 4..h - h / 4).contains(&y);
        let v = if inside { 220 } else { 30 };
        image::Rgb([v, v, v])
    })
}

/// A health check's job: its image, alpha only.
pub(crate) fn health_check_job() -> MatteJob {
    MatteJob {
        image: Arc::new(pixels::from_image(health_check_image())),
        timings: StageTimings::default(),
        planes: Planes::ALPHA,
    }
}

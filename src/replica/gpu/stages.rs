//! `GpuStages`: one replica's stages between decode and encode on one GPU stream. The
//! decoded RGB8 goes up once (`transfer`), the segmentation input is made (`input`) and
//! its model runs (`model`), the trimap (`mask`) and matting (`matting`) follow, and
//! alpha, trimap and the cut-out come down once, with one synchronisation at the end
//! (`clock` reads the stage times then). Device buffers are allocated at start-up for
//! the largest accepted image and reused: the request path allocates nothing on the GPU.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaStream;
use image::{RgbImage, RgbaImage};

use super::buffers::{GpuLimits, SourcePlanes};
use super::clock::{Mark, ModelPlaces, StageClock};
use super::error::GpuError;
use super::input::InputStage;
use super::mask::MaskStage;
use super::matting::Matting;
use super::model::{GpuModel, ModelSource};
use super::transfer::Transfer;
use crate::cuda::launch::Launcher;
use crate::cuda::GpuDevice;
use crate::matte::{Matte, StageTimings};
use crate::replica::models;
use crate::spec::PipelineSpec;

/// The GPU stages' result: the matte, and the RGBA cut-out when it was asked for.
#[derive(Debug, Clone)]
pub struct GpuMatte {
    pub matte: Matte,
    pub cutout: Option<RgbaImage>,
}

/// The segmentation model and the making of its input.
struct Segmentation {
    input: InputStage,
    model: GpuModel,
}

/// One replica of the pipeline on one GPU.
pub struct GpuStages {
    spec: PipelineSpec,
    limits: GpuLimits,
    segmentation: Segmentation,
    mask: MaskStage,
    matting: Matting,
    planes: SourcePlanes,
    transfer: Transfer,
    clock: StageClock,
    stream: Arc<CudaStream>,
    device: Arc<GpuDevice>,
}

impl GpuStages {
    /// Sets up the models of `spec` from `source` (each learns its output's shape), and
    /// every device buffer for images up to `limits`, on a new stream of `device`.
    pub fn load(
        spec: &PipelineSpec,
        device: Arc<GpuDevice>,
        source: ModelSource<'_>,
        limits: GpuLimits,
    ) -> Result<Self, GpuError> {
        device.context().bind_to_thread()?;
        let stream = device.new_stream()?;
        let (engine, threads) = match &source {
            ModelSource::TensorRt { segmentation, .. } => (Some(*segmentation), 1),
            ModelSource::OnnxRuntime { intra_threads } => (None, *intra_threads),
        };
        let model = GpuModel::load(
            &models::segmentation(spec),
            engine,
            threads,
            &device,
            &stream,
        )?;
        let mask = MaskStage::alloc(&stream, spec, model.output_shape(), limits.max_side_px)?;
        let matting = Matting::load(spec, &source, mask.size(), &limits, &device, &stream)?;
        let pipeline = Self {
            segmentation: Segmentation {
                input: InputStage::alloc(&stream, &spec.segmentation.image, &limits)?,
                model,
            },
            mask,
            matting,
            planes: SourcePlanes::alloc(&stream, &limits)?,
            transfer: Transfer::new(&stream),
            clock: StageClock::new(&device)?,
            spec: spec.clone(),
            limits,
            stream,
            device,
        };
        pipeline.stream.synchronize()?;
        Ok(pipeline)
    }

    /// "TensorRT" or "ONNX Runtime (CPU)": what runs this replica's models.
    pub fn model_backend(&self) -> &'static str {
        if self.segmentation.model.on_gpu() {
            "TensorRT"
        } else {
            "ONNX Runtime (CPU)"
        }
    }

    /// Host memory this replica holds page-locked now: the upload and download staging,
    /// grown to the largest request so far (ONNX Runtime models' input staging aside).
    pub fn pinned_host_bytes(&self) -> usize {
        self.transfer.pinned_bytes()
    }

    /// Runs every stage between decode and encode on `image`; with `cutout`, the RGBA
    /// cut-out is made on the GPU too. Stage times: wall time for the host parts, event
    /// time for the GPU's.
    pub fn run(
        &mut self,
        image: &RgbImage,
        cutout: bool,
        timings: &mut StageTimings,
    ) -> Result<GpuMatte, GpuError> {
        let size = self.limits.accept(image.width(), image.height())?;
        let wall = Instant::now();
        // A request that failed half-way may have left copies in flight from the staging
        // or into the buffers; they must finish before either is written again.
        self.stream.synchronize()?;
        self.prepare(size, cutout)?;
        let stream = self.stream.clone();
        let device = self.device.clone();
        let launcher = Launcher {
            stream: &stream,
            kernels: device.kernels(),
        };
        self.clock.mark(Mark::Start, &stream)?;
        self.transfer.upload(image, &mut self.planes.image)?;
        let seg = &mut self.segmentation;
        seg.input
            .run(&launcher, &self.planes.image, size, seg.model.input(0)?)?;
        self.clock.mark(Mark::Preprocessed, &stream)?;
        if let Some(host) = seg.model.run(&launcher)? {
            timings.preprocess = host.inputs_ready - wall;
            timings.model = host.model;
        }
        self.clock.mark(Mark::MaskReady, &stream)?;
        let mask = seg.model.output();
        self.mask
            .run(&launcher, &self.spec, mask, size, &mut self.planes.trimap)?;
        self.clock.mark(Mark::Trimapped, &stream)?;
        let matting = self.matting.run(
            &launcher,
            &mut self.planes,
            size,
            &self.mask,
            cutout,
            &self.clock,
        )?;
        if let Some(host) = matting {
            timings.model += host.model;
        }
        self.clock.mark(Mark::Composited, &stream)?;
        self.finish(size, cutout, timings)
    }

    /// Everything a request of `size` needs before its first copy, while the stream is
    /// idle: the staging, and every resize table. The tables come from pageable host
    /// memory, whose copies the driver may serialise with the stream: made mid-request,
    /// after an engine is queued, they would wait for it. The stages' own calls then find
    /// the tables in place and upload nothing.
    fn prepare(&mut self, size: (u32, u32), cutout: bool) -> Result<(), GpuError> {
        let stream = &self.stream;
        self.transfer
            .reserve(size.0 as usize * size.1 as usize, cutout)?;
        self.segmentation.input.upload_taps(stream, size)?;
        self.mask.upload_tables(stream, size)?;
        self.matting.upload_tables(stream, size, &self.mask)?;
        Ok(())
    }

    /// The one download and synchronisation, and the stage times the events hold.
    fn finish(
        &mut self,
        size: (u32, u32),
        cutout: bool,
        timings: &mut StageTimings,
    ) -> Result<GpuMatte, GpuError> {
        let t = Instant::now();
        let p = &self.planes;
        let rgba = cutout.then_some(&p.rgba);
        let down = self.transfer.download(size, &p.alpha, &p.trimap, rgba)?;
        let places = ModelPlaces {
            segmentation_on_gpu: self.segmentation.model.on_gpu(),
            matting_model_on_gpu: self.matting.model_on_gpu(),
            guided: self.matting.is_guided(),
        };
        self.clock.read(places, t.elapsed(), timings);
        Ok(GpuMatte {
            matte: Matte {
                alpha: down.alpha,
                trimap: down.trimap,
            },
            cutout: down.cutout,
        })
    }
}

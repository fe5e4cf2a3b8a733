//! `GpuStages`: one replica's stages between decode and encode on one GPU stream. The
//! decoded RGB8 goes up once (`transfer`), the segmentation input is made (`input`) and
//! its model runs (`model`), the trimap (`mask`) and matting (`matting`) follow, and
//! the planes the answer shows come down once (a cut-out alone for a cut-out), with one
//! synchronisation at the end (`clock` reads the stage times then). Device buffers are
//! allocated at start-up and reused, and the copies read and write the host blocks the
//! decoder and encoder use: the request path allocates nothing on the GPU, pins nothing
//! and copies no pixels on the host.

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cuda::driver::CudaStream;

use super::buffers::{GpuLimits, SourcePlanes};
use super::clock::{Mark, ModelPlaces, StageClock};
use super::error::GpuError;
use super::input::InputStage;
use super::mask::MaskStage;
use super::matting::Matting;
use super::model::{GpuModel, ModelSource};
use super::transfer::{DevicePlanes, Transfer};
use crate::cuda::launch::Launcher;
use crate::cuda::GpuDevice;
use crate::matte::{MattePlanes, Planes, StageTimings};
use crate::pixels::{self, RgbPixels, SharedAlloc};
use crate::replica::models;
use crate::spec::PipelineSpec;

/// A clock of the calling thread's CPU time, for a benchmark that splits a request's host
/// work from its waits (`GpuStages::measure_waits`).
pub type ThreadCpuClock = fn() -> Option<Duration>;

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
    /// A request failed part-way, and may have left copies in flight from its host blocks
    /// or into the buffers: the next one synchronises before touching either.
    unsettled: bool,
    /// With a benchmark's clock: the thread CPU time the last request spent waiting for
    /// the stream (on the stand-in driver, the device's work runs there).
    wait_clock: Option<ThreadCpuClock>,
    last_wait_cpu: Duration,
}

impl GpuStages {
    /// Sets up the models of `spec` from `source` (each learns its output's shape), and
    /// every device buffer for images up to `limits`, on a new stream of `device`;
    /// downloads go into blocks from `blocks` (the server's page-locked pool, attached to
    /// `device`'s context).
    pub fn load(
        spec: &PipelineSpec,
        device: Arc<GpuDevice>,
        source: ModelSource<'_>,
        limits: GpuLimits,
        blocks: SharedAlloc,
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
        let mut pipeline = Self {
            segmentation: Segmentation {
                input: InputStage::alloc(&stream, &spec.segmentation.image, &limits)?,
                model,
            },
            mask,
            matting,
            planes: SourcePlanes::alloc(&stream, &limits)?,
            transfer: Transfer::new(&stream, blocks),
            clock: StageClock::new(&device)?,
            spec: spec.clone(),
            limits,
            stream,
            device,
            unsettled: false,
            wait_clock: None,
            last_wait_cpu: Duration::ZERO,
        };
        pipeline.stream.synchronize()?;
        pipeline.warm_up()?;
        Ok(pipeline)
    }

    /// One small request with every plane, at load: the first launch of each kernel, the
    /// engines' first enqueue and the driver's lazy loading are paid here, not by the
    /// first client.
    fn warm_up(&mut self) -> Result<(), GpuError> {
        let image = Arc::new(pixels::from_image(crate::replica::health_check_image()));
        self.run(&image, Planes::ALL, &mut StageTimings::default())?;
        Ok(())
    }

    /// One request of each of `sizes` with every plane, at load (`GpuServing::warmup`).
    pub fn warm_up_at(&mut self, sizes: &[(u32, u32)]) -> Result<(), GpuError> {
        for &(w, h) in sizes {
            let image = Arc::new(pixels::from_image(crate::replica::warmup_image(w, h)));
            self.run(&image, Planes::ALL, &mut StageTimings::default())?;
        }
        Ok(())
    }

    /// "TensorRT" or "ONNX Runtime (CPU)": what runs this replica's models.
    pub fn model_backend(&self) -> &'static str {
        if self.segmentation.model.on_gpu() {
            "TensorRT"
        } else {
            "ONNX Runtime (CPU)"
        }
    }

    /// For a benchmark: time each request's waits for the stream with `clock` (the
    /// calling thread's CPU time), read back with `last_wait_cpu`.
    pub fn measure_waits(&mut self, clock: Option<ThreadCpuClock>) {
        self.wait_clock = clock;
    }

    /// The thread CPU time the last request spent in its waits for the stream (zero
    /// without `measure_waits`).
    pub fn last_wait_cpu(&self) -> Duration {
        self.last_wait_cpu
    }

    /// Waits for the stream, timing the wait on the benchmark's clock if one is set.
    fn wait_for_stream(&mut self) -> Result<(), GpuError> {
        let before = self.wait_clock.and_then(|clock| clock());
        self.stream.synchronize()?;
        if let (Some(clock), Some(before)) = (self.wait_clock, before) {
            if let Some(after) = clock() {
                self.last_wait_cpu += after.saturating_sub(before);
            }
        }
        Ok(())
    }

    /// Runs every stage between decode and encode on `image` and hands back the `planes`
    /// asked for (a cut-out is made on the GPU). Stage times: wall time for the host
    /// parts, event time for the GPU's.
    pub fn run(
        &mut self,
        image: &Arc<RgbPixels>,
        planes: Planes,
        timings: &mut StageTimings,
    ) -> Result<MattePlanes, GpuError> {
        let size = self.limits.accept(image.width(), image.height())?;
        let wall = Instant::now();
        self.last_wait_cpu = Duration::ZERO;
        if self.unsettled {
            // The last request failed half-way and may have left copies in flight from its
            // blocks or into the buffers; they must finish before either is used again.
            self.wait_for_stream()?;
        }
        self.unsettled = true;
        let out = self.run_settled(image, size, planes, wall, timings)?;
        self.unsettled = false;
        Ok(out)
    }

    fn run_settled(
        &mut self,
        image: &Arc<RgbPixels>,
        size: (u32, u32),
        planes: Planes,
        wall: Instant,
        timings: &mut StageTimings,
    ) -> Result<MattePlanes, GpuError> {
        let cutout = planes.cutout;
        self.prepare(size)?;
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
        self.finish(size, planes, timings)
    }

    /// Everything a request of `size` needs before its first copy: the last request's
    /// blocks given back (the stream is idle), and every resize table, made on the
    /// device by the table kernels (tables.cu) queued on the stream when the size
    /// changed (nothing uploaded, nothing waited for; nothing launched for the size the
    /// tables are already for). The stages' own calls then find the tables in place.
    fn prepare(&mut self, size: (u32, u32)) -> Result<(), GpuError> {
        self.transfer.settle();
        let launcher = Launcher {
            stream: &self.stream,
            kernels: self.device.kernels(),
        };
        self.segmentation.input.make_taps(&launcher, size)?;
        self.mask.make_tables(&launcher, size)?;
        self.matting.make_tables(&launcher, size, &self.mask)?;
        Ok(())
    }

    /// The one download and synchronisation, and the stage times the events hold.
    fn finish(
        &mut self,
        size: (u32, u32),
        planes: Planes,
        timings: &mut StageTimings,
    ) -> Result<MattePlanes, GpuError> {
        let t = Instant::now();
        let p = &self.planes;
        self.transfer.queue_download(
            size,
            planes,
            DevicePlanes {
                alpha: &p.alpha,
                trimap: &p.trimap,
                rgba: &p.rgba,
            },
        )?;
        self.wait_for_stream()?;
        let down = self.transfer.take()?;
        let places = ModelPlaces {
            segmentation_on_gpu: self.segmentation.model.on_gpu(),
            matting_model_on_gpu: self.matting.model_on_gpu(),
            guided: self.matting.is_guided(),
        };
        self.clock.read(places, t.elapsed(), timings);
        Ok(MattePlanes {
            width: size.0,
            height: size.1,
            alpha: down.alpha,
            trimap: down.trimap,
            cutout: down.cutout,
        })
    }
}

//! A CPU replica: the pipeline's stages (`crate::stages`) in order around its own ONNX
//! Runtime sessions, one request (or one batch) at a time, and the `Executor` the
//! scheduler runs it through. The CPU path is the embedded default and the reference
//! every GPU kernel is tested against.

use std::sync::Arc;
use std::time::Instant;

use fast_image_resize::Resizer;
use image::{GrayImage, RgbaImage};

use super::cores::CoreShare;
use super::models::{self, nchw, ModelError};
use super::{health_check_job, warmup_image, BoxedMatteExecutor, MatteJob, MatteOutput};
use crate::matte::{Matte, MattePlanes, Planes, StageTimings};
use crate::ort::session::{OpThreads, OrtModel};
use crate::ort::OrtError;
use crate::pixels::{self, GrayPixels, RgbPixels, SharedAlloc};
use crate::sched::{Device, DeviceSetup, ExecError, Executor, LoadFn, RunParts, WarmRun, Work};
use crate::spec::{ImageInputSpec, MaskKind, MattingSpec, PipelineSpec};
use crate::stages::lanes::Lanes;
use crate::stages::plane::Plane;
use crate::stages::{
    composite, guided_filter, preprocess, resample, trimap, Bytes, Rgb8, StageError,
};
use crate::tensor::Tensor;

/// Why the CPU stages failed: the models or their outputs, never the client's input.
#[derive(Debug, thiserror::Error)]
pub enum CpuError {
    #[error(transparent)]
    Backend(#[from] OrtError),
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A CPU stage refused what it was given.
    #[error("{stage}: {source}")]
    Stage {
        stage: &'static str,
        source: StageError,
    },
    /// The pipeline's own bookkeeping: a batch and its outputs that do not match.
    #[error("{stage}: {reason}")]
    Batch { stage: &'static str, reason: String },
    #[error("matting: expected an alpha of shape [1, 1, H, W], got {0:?}")]
    AlphaShape(Vec<usize>),
}

/// The error of `stage`, for `map_err`.
fn in_stage(stage: &'static str) -> impl Fn(StageError) -> CpuError {
    move |source| CpuError::Stage { stage, source }
}

/// How a set of sessions makes the alpha at the source size. The matting model's session
/// is in its variant, so there is no model matting without a session, nor a session
/// without model matting.
enum Matting {
    /// The fast guided filter of the coarse mask, guided by the image's luma.
    GuidedFilter {
        radius_px: u32,
        epsilon: f32,
        subsample: u32,
    },
    /// The matting model on the image and the trimap at its input size, its alpha
    /// resized to the source.
    Model(Box<MattingModel>),
}

/// The matting model's session, and its input and output names.
struct MattingModel {
    session: OrtModel,
    image: ImageInputSpec,
    trimap_input: String,
    output: String,
}

impl Matting {
    /// The matting `spec` describes, its model (if any) on `threads`, checked against the
    /// names the description gives.
    fn load(spec: &PipelineSpec, threads: OpThreads) -> Result<Self, CpuError> {
        Ok(match &spec.matting {
            &MattingSpec::GuidedFilter {
                radius_px,
                epsilon,
                subsample,
            } => Matting::GuidedFilter {
                radius_px,
                epsilon,
                subsample,
            },
            MattingSpec::Model {
                image,
                trimap_input,
                output,
            } => Matting::Model(Box::new(MattingModel {
                session: models::matting_model(image, trimap_input, output).load_ort(threads)?,
                image: image.clone(),
                trimap_input: trimap_input.clone(),
                output: output.clone(),
            })),
        })
    }
}

/// The models one run of the pipeline uses: the segmentation model's session and the
/// matting (the guided filter's parameters, or the matting model with its session); and
/// the cores they were given, which the stages around the models may split their rows
/// across for the same run.
pub struct Sessions {
    segmentation: OrtModel,
    matting: Matting,
    lanes: Lanes,
}

impl Sessions {
    /// Every model of `spec` on `threads`, checked against the names the description
    /// gives.
    pub fn load(spec: &PipelineSpec, threads: OpThreads) -> Result<Self, CpuError> {
        let segmentation = models::segmentation(spec).load_ort(threads)?;
        check_batching(&segmentation, spec)?;
        let matting = Matting::load(spec, threads)?;
        let lanes = match threads {
            OpThreads::Own { threads, .. } => Lanes::new(threads),
            OpThreads::Shared => Lanes::ONE,
        };
        Ok(Self {
            segmentation,
            matting,
            lanes,
        })
    }
}

/// A CPU device's cores as its replicas share them (see `super::cores`).
pub type CpuCores = CoreShare<Sessions>;

/// Gives back what the CPU replicas keep between requests and are not using now (the
/// server has gone idle): their guided filters' buffers.
pub fn release_kept_buffers() {
    guided_filter::release_kept_scratch();
}

/// The cores of a CPU device: `solo_threads` threads for a replica running alone, when
/// that is more than each replica's own `replica_threads`.
pub fn cpu_cores(
    spec: &PipelineSpec,
    replica_threads: usize,
    solo_threads: usize,
) -> Result<CpuCores, CpuError> {
    let solo = (solo_threads > replica_threads)
        .then(|| {
            Sessions::load(
                spec,
                OpThreads::Own {
                    threads: solo_threads,
                    alone: true,
                },
            )
        })
        .transpose()?;
    Ok(CoreShare::new(solo))
}

/// One replica on the CPU: its own sessions (so `run` needs no lock), the device's solo
/// sessions it may borrow, and scratch reused from request to request, so the hot path
/// allocates little.
pub struct CpuStages {
    sessions: Sessions,
    cores: Arc<CpuCores>,
    /// Requests waiting for the device as the next run starts (`note_waiting`).
    waiting: usize,
    stages: Stages,
}

/// The stages around the models, and their scratch.
struct Stages {
    spec: PipelineSpec,
    resizer: Resizer,
    resized: Vec<u8>,
    input: Vec<f32>,
    /// The stacked [N, 3, h, w] segmentation input of a batch.
    batch: Vec<f32>,
    /// The guided filter's buffers, kept from one image to the next (and given back
    /// when the server goes idle).
    guided: guided_filter::KeptScratch,
    /// Where the planes handed back (alpha, trimap) are made: the server's allocator,
    /// whose large blocks are kept and lent again (`pixels::RecyclingHeap`).
    pixels: SharedAlloc,
}

/// The values of one image's `[1, 3, h, w]` model input.
fn input_len(spec: &ImageInputSpec) -> usize {
    nchw(spec, 3).iter().product()
}

/// The `[1, 3, h, w]` values a model with input `spec` reads for `image`, prepared as a
/// replica prepares them (calibration measures what serving will feed).
pub fn model_input(image: &Rgb8<impl Bytes>, spec: &ImageInputSpec) -> Vec<f32> {
    let mut out = vec![0f32; input_len(spec)];
    prepare_into(Lanes::ONE, &mut Vec::new(), image, spec, &mut out);
    out
}

/// Resize (into `resized`, its rows across `lanes`) + normalise `image` for `spec` into
/// `out`, which holds `input_len(spec)` values: one image's slot of a model input.
fn prepare_into(
    lanes: Lanes,
    resized: &mut Vec<u8>,
    image: &Rgb8<impl Bytes>,
    spec: &ImageInputSpec,
    out: &mut [f32],
) {
    preprocess::resize_rgb_in(lanes, image, spec.width, spec.height, resized);
    preprocess::normalize_into(resized, &spec.normalize, out);
}

impl CpuStages {
    /// A replica alone on the cores: every model of `spec` with `intra_threads` ONNX
    /// Runtime threads each, checked against the names the description gives.
    pub fn load(spec: &PipelineSpec, intra_threads: usize) -> Result<Self, CpuError> {
        Self::on(spec, intra_threads, Arc::new(CoreShare::new(None)))
    }

    /// A replica of a device whose cores are `cores`, with `intra_threads` threads of
    /// its own.
    pub fn on(
        spec: &PipelineSpec,
        intra_threads: usize,
        cores: Arc<CpuCores>,
    ) -> Result<Self, CpuError> {
        let sessions = Sessions::load(spec, intra_threads.into())?;
        Ok(Self {
            sessions,
            cores,
            waiting: 0,
            stages: Stages {
                spec: spec.clone(),
                resizer: Resizer::new(),
                resized: Vec::new(),
                input: Vec::new(),
                batch: Vec::new(),
                guided: guided_filter::KeptScratch::default(),
                pixels: pixels::heap(),
            },
        })
    }

    /// Makes the planes it hands back with `pixels` (the heap's, by default).
    pub fn with_pixels(mut self, pixels: SharedAlloc) -> Self {
        self.stages.pixels = pixels;
        self
    }

    /// Runs every stage between decode and composite on `image`, recording the time of
    /// each in `timings`: a batch of one.
    pub fn run(
        &mut self,
        image: &Rgb8<impl Bytes>,
        timings: &mut StageTimings,
    ) -> Result<Matte, CpuError> {
        self.run_batch(&[image], std::slice::from_mut(timings))?
            .pop()
            .ok_or_else(|| CpuError::Batch {
                stage: "batch",
                reason: "no matte for the image".into(),
            })
    }

    /// The device stages of several images with one segmentation run: each input is
    /// normalised into its slot of one [N, 3, h, w] tensor (`load` checked that the
    /// model's batch dimension is dynamic when N can exceed 1) and the output is split
    /// per image; trimap and matting then run image by image. Each image's
    /// `timings.model` is the whole batch's model time. The models run on the device's
    /// solo sessions when no other replica is running and no request waits (see
    /// `note_waiting`), else on this replica's own; preprocess and the guided filter
    /// split their rows across as many threads as those sessions have (`Lanes`), so a
    /// lone large image uses the idle cores and a busy device's stages stay on their
    /// replica's thread.
    pub fn run_batch(
        &mut self,
        images: &[&Rgb8<impl Bytes>],
        timings: &mut [StageTimings],
    ) -> Result<Vec<Matte>, CpuError> {
        let running = self.cores.enter();
        let mut solo = self
            .cores
            .lend_solo(&running, std::mem::take(&mut self.waiting));
        match solo.as_deref_mut() {
            Some(solo_sessions) => self.stages.run_batch(solo_sessions, images, timings),
            None => self.stages.run_batch(&mut self.sessions, images, timings),
        }
    }

    /// How many requests wait for the device behind the next run.
    pub fn note_waiting(&mut self, waiting: usize) {
        self.waiting = waiting;
    }
}

impl Stages {
    fn run_batch(
        &mut self,
        sessions: &mut Sessions,
        images: &[&Rgb8<impl Bytes>],
        timings: &mut [StageTimings],
    ) -> Result<Vec<Matte>, CpuError> {
        if images.len() != timings.len() {
            return Err(CpuError::Batch {
                stage: "batch",
                reason: format!("{} images but {} timings", images.len(), timings.len()),
            });
        }
        if images.is_empty() {
            return Ok(Vec::new());
        }
        let n = images.len();
        let seg = &self.spec.segmentation;
        let per_image = input_len(&seg.image);
        self.batch.resize(n * per_image, 0.0);
        let slots = self.batch.chunks_exact_mut(per_image);
        for ((image, t), slot) in images.iter().zip(timings.iter_mut()).zip(slots) {
            let start = Instant::now();
            prepare_into(sessions.lanes, &mut self.resized, image, &seg.image, slot);
            t.preprocess = start.elapsed();
        }
        let start = Instant::now();
        let [_, c, h, w] = nchw(&seg.image, 3);
        let out = sessions.segmentation.run(
            &[(seg.image.input.as_str(), [n, c, h, w], &self.batch)],
            &seg.output,
        )?;
        let model_time = start.elapsed();
        let per_image = split_batch(out, n)?;
        let mut mattes = Vec::with_capacity(n);
        for ((image, t), out) in images.iter().zip(timings.iter_mut()).zip(per_image) {
            t.model = model_time;
            mattes.push(self.finish(sessions, image, &out, t)?);
        }
        Ok(mattes)
    }

    /// Trimap and matting of one image from its segmentation output (batch of one).
    fn finish(
        &mut self,
        sessions: &mut Sessions,
        image: &Rgb8<impl Bytes>,
        out: &Tensor,
        timings: &mut StageTimings,
    ) -> Result<Matte, CpuError> {
        let (width, height) = image.dimensions();
        let t = Instant::now();
        let (mut small_trimap, coarse) = self.trimap(out)?;
        trimap::erode(&mut small_trimap, self.spec.trimap.erode_px);
        let mut trimap_full = self.plane(width, height)?;
        resample::resize_nearest_into(&small_trimap, width, height, &mut trimap_full);
        timings.trimap = t.elapsed();

        let t = Instant::now();
        let lanes = sessions.lanes;
        let alpha = match &mut sessions.matting {
            &mut Matting::GuidedFilter {
                radius_px,
                epsilon,
                subsample,
            } => {
                let mut scratch = self.guided.lock();
                let model = guided_filter::fit_in(
                    lanes,
                    &mut self.resizer,
                    &mut scratch,
                    image,
                    &coarse,
                    radius_px,
                    epsilon,
                    subsample,
                )
                .map_err(in_stage("matting"))?;
                let mut alpha = self.plane(width, height)?;
                model.alpha_into(lanes, image, trimap_full.as_raw(), &mut alpha);
                scratch.keep_model(model);
                alpha
            }
            Matting::Model(m) => {
                let MattingModel {
                    session,
                    image: input,
                    trimap_input,
                    output,
                } = &mut **m;
                self.input.resize(input_len(input), 0.0);
                prepare_into(lanes, &mut self.resized, image, input, &mut self.input);
                let alpha = run_matting_model(
                    session,
                    &self.input,
                    &small_trimap,
                    input,
                    trimap_input,
                    output,
                )?;
                let full = resample::resize_plane(&mut self.resizer, &alpha, width, height)
                    .map_err(in_stage("matting"))?;
                pixels::from_image(composite::quantize_alpha(&full))
            }
        };
        timings.matting = t.elapsed();
        Ok(Matte {
            alpha,
            trimap: trimap_full,
        })
    }

    /// A `width` x `height` plane from the server's allocator, its bytes unspecified.
    fn plane(&self, width: u32, height: u32) -> Result<GrayPixels, CpuError> {
        let len = width as usize * height as usize;
        GrayPixels::from_raw(width, height, self.pixels.alloc(len)).ok_or_else(|| CpuError::Batch {
            stage: "matting",
            reason: format!("no plane of {width}x{height} from {len} bytes"),
        })
    }

    /// The trimap at the segmentation output's resolution, and the coarse mask in [0, 1].
    fn trimap(&self, out: &Tensor) -> Result<(GrayImage, Plane), CpuError> {
        match &self.spec.segmentation.mask {
            MaskKind::Probability { minmax } => {
                let mask = trimap::probability_mask(out, *minmax).map_err(in_stage("trimap"))?;
                let t = trimap::threshold(
                    &mask,
                    self.spec.trimap.foreground,
                    self.spec.trimap.background,
                );
                Ok((t, mask))
            }
            MaskKind::Classes { class_values } => {
                trimap::classes(out, class_values).map_err(in_stage("trimap"))
            }
        }
    }
}

/// The matting model on the prepared image input and the trimap, both at the model's
/// input size.
fn run_matting_model(
    model: &mut OrtModel,
    image_input: &[f32],
    small_trimap: &GrayImage,
    spec: &ImageInputSpec,
    trimap_input: &str,
    output: &str,
) -> Result<Plane, CpuError> {
    let trimap = resample::resize_nearest(small_trimap, spec.width, spec.height);
    let trimap: Vec<f32> = trimap
        .as_raw()
        .iter()
        .map(|&v| f32::from(v) / 255.0)
        .collect();
    let out: Tensor = model.run(
        &[
            (spec.input.as_str(), nchw(spec, 3), image_input),
            (trimap_input, nchw(spec, 1), &trimap),
        ],
        output,
    )?;
    match out.shape.as_slice() {
        [1, 1, h, w] => Ok(Plane::new(*w as u32, *h as u32, out.data)),
        shape => Err(CpuError::AlphaShape(shape.to_vec())),
    }
}

/// `[batching]` with more than one request per run needs a dynamic batch dimension on the
/// segmentation input; a fixed one (U2NetP's is 1) would fail at the first batch.
fn check_batching(model: &OrtModel, spec: &PipelineSpec) -> Result<(), OrtError> {
    let seg = &spec.segmentation;
    if spec.batching.max_batch <= 1 {
        return Ok(());
    }
    let shape = model
        .inputs()
        .into_iter()
        .find(|d| d.name == seg.image.input)
        .map(|d| d.shape)
        .unwrap_or_default();
    if shape.first().is_some_and(|&b| b < 0) {
        return Ok(());
    }
    Err(OrtError::Mismatch {
        model: model.label().to_string(),
        reason: format!(
            "{}: [batching] max_batch = {} needs a dynamic batch dimension on input `{}`, whose shape is {:?}; remove [batching] or export the model with a dynamic batch",
            spec.source.display(),
            spec.batching.max_batch,
            seg.image.input,
            shape
        ),
    })
}

/// Splits a [N, ...] model output into N outputs of shape [1, ...].
fn split_batch(out: Tensor, n: usize) -> Result<Vec<Tensor>, CpuError> {
    if out.shape.first() != Some(&n) || n == 0 || !out.data.len().is_multiple_of(n) {
        return Err(CpuError::Batch {
            stage: "model",
            reason: format!("a batch of {n} gave an output of shape {:?}", out.shape),
        });
    }
    if n == 1 {
        return Ok(vec![out]);
    }
    let per_image = out.data.len() / n;
    let mut shape = out.shape.clone();
    shape[0] = 1;
    Ok(out
        .data
        .chunks_exact(per_image)
        .map(|chunk| Tensor {
            shape: shape.clone(),
            data: chunk.to_vec(),
        })
        .collect())
}

/// The RGBA cut-out of `image` under `matte`'s alpha, timed as the composite stage.
pub fn timed_cutout(
    image: &Rgb8<impl Bytes>,
    matte: &Matte,
    timings: &mut StageTimings,
) -> RgbaImage {
    let t = Instant::now();
    let rgba = composite::cutout(image, &matte.alpha);
    timings.composite = t.elapsed();
    rgba
}

/// One CPU replica as the scheduler runs it.
pub struct CpuExecutor {
    pipeline: CpuStages,
    /// The image sizes it runs at load (`--warmup-size`).
    warmup: Vec<(u32, u32)>,
}

impl CpuExecutor {
    pub fn new(pipeline: CpuStages) -> Self {
        Self {
            pipeline,
            warmup: Vec::new(),
        }
    }

    /// Runs an image of each of `sizes` at load (`Executor::warm_up`).
    pub fn with_warmup(mut self, sizes: Vec<(u32, u32)>) -> Self {
        self.warmup = sizes;
        self
    }
}

impl Executor for CpuExecutor {
    type Input = MatteJob;
    type Output = MatteOutput;

    /// One segmentation run for the batch; each job that asked for the cut-out gets it
    /// composited here, on the replica, as a GPU makes it on the device.
    fn run_batch(&mut self, jobs: &[&MatteJob]) -> Result<Vec<MatteOutput>, ExecError> {
        let images: Vec<&RgbPixels> = jobs.iter().map(|j| j.image.as_ref()).collect();
        let mut timings: Vec<StageTimings> = jobs.iter().map(|j| j.timings).collect();
        let mattes = self.pipeline.run_batch(&images, &mut timings)?;
        Ok(mattes
            .into_iter()
            .zip(timings)
            .zip(jobs)
            .map(|((matte, mut timings), job)| {
                let cutout = job
                    .planes
                    .cutout
                    .then(|| timed_cutout(&job.image, &matte, &mut timings));
                MatteOutput {
                    planes: MattePlanes::from_matte(matte, cutout),
                    timings,
                }
            })
            .collect())
    }

    fn note_waiting(&mut self, waiting: usize) {
        self.pipeline.note_waiting(waiting);
    }

    fn parts(&self, output: &MatteOutput) -> Option<RunParts> {
        Some(output.run_parts())
    }

    /// Each warm-up size twice, every plane: the first run pays what only a first run
    /// does (on the 2-core machines, a server's first seconds under 12 MP traffic spent
    /// 85 % of the CPU in the kernel, faulting its memory in); the second is timed.
    fn warm_up(&mut self) -> Result<Vec<WarmRun>, ExecError> {
        let mut timed = Vec::with_capacity(self.warmup.len());
        for &(w, h) in &self.warmup.clone() {
            let job = MatteJob::new(
                Arc::new(pixels::from_image(warmup_image(w, h))),
                StageTimings::default(),
                Planes::ALL,
            );
            self.run_batch(&[&job])?;
            let start = Instant::now();
            let outputs = self.run_batch(&[&job])?;
            timed.push(WarmRun {
                work: Work::of_image(w, h, true),
                took: start.elapsed(),
                parts: outputs.first().map(MatteOutput::run_parts),
            });
        }
        Ok(timed)
    }

    fn health_check(&mut self) -> Result<(), ExecError> {
        let job = health_check_job();
        self.pipeline
            .run(&job.image, &mut StageTimings::default())
            .map(|_| ())
            .map_err(Into::into)
    }
}

/// The CPU as a device of `celer serve` or `celer run` for `spec`: `replicas` replicas,
/// each with its own sessions of `threads` ONNX Runtime threads, and solo sessions of
/// `solo_threads` that a replica running alone borrows (`super::cores`). (GPUs: `gpu`.)
pub fn cpu_device_setup(
    spec: &PipelineSpec,
    replicas: usize,
    threads: usize,
    solo_threads: usize,
    warmup: &[(u32, u32)],
    pixels: SharedAlloc,
) -> DeviceSetup<BoxedMatteExecutor> {
    let warmup = warmup.to_vec();
    let batching = spec.batching;
    let spec = spec.clone();
    // Loaded with the first replica (loading can fail, and fails as a replica's load
    // does), then shared by every replica of the device, replacements included.
    let cores: Arc<std::sync::Mutex<Option<Arc<CpuCores>>>> = Arc::default();
    let load: LoadFn<BoxedMatteExecutor> = Arc::new(move |_replica| {
        let shared = {
            let mut cores = cores.lock().unwrap_or_else(|p| p.into_inner());
            match &*cores {
                Some(shared) => shared.clone(),
                None => cores
                    .insert(Arc::new(cpu_cores(&spec, threads, solo_threads)?))
                    .clone(),
            }
        };
        let pipeline = CpuStages::on(&spec, threads, shared)?.with_pixels(pixels.clone());
        let executor = CpuExecutor::new(pipeline).with_warmup(warmup.clone());
        Ok(Box::new(executor) as BoxedMatteExecutor)
    });
    DeviceSetup {
        name: Device::Cpu.to_string(),
        replicas,
        batching,
        load,
        interim: false,
    }
}

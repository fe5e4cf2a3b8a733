//! `GpuPipeline`: one replica's stages between decode and encode on one GPU stream. The
//! decoded RGB8 goes up once through pinned memory, every kernel runs on the replica's
//! stream, and alpha, trimap (and the RGBA cut-out) come down once, with one
//! synchronisation at the end. Every device buffer is allocated at start-up for the
//! largest accepted image and reused: the request path allocates nothing on the device.
//!
//! The models (`model`): TensorRT engines enqueued on the same stream, reading and
//! writing device buffers, so a request crosses the bus once each way. Where TensorRT is
//! absent they run on the CPU with ONNX Runtime: the normalised input is downloaded, the
//! session runs, and its output is uploaded again, one extra synchronisation per model.

use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, PinnedHostSlice};
use image::{GrayImage, RgbImage, RgbaImage};

use super::device::GpuDevice;
use super::guided::{FastGuidedFilter, GuidedParams};
use super::launch::{taps_capacity, DeviceNearest, DeviceTaps, Launcher};
use super::model::{DeviceTensor, GpuModel, InputElement, TrtModel};
use super::CudaError;
use crate::backend::Tensor;
use crate::config::{ImageInputSpec, MaskKind, MattingSpec, PipelineSpec};
use crate::pipeline::{Matte, StageTimings};
use crate::tensorrt::Engine;

/// The largest image the GPU buffers hold. Larger images are refused with
/// [`CudaError::ImageTooLarge`] (the caller can run them on the CPU path).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuLimits {
    pub max_pixels: u64,
    pub max_side_px: u32,
}

impl Default for GpuLimits {
    /// The decoder's default limits, so that every image it accepts fits.
    fn default() -> Self {
        let decode = crate::pipeline::decode::DecodeLimits::default();
        Self {
            max_pixels: decode.max_pixels,
            max_side_px: decode.max_side_px,
        }
    }
}

/// The GPU stages' result: the matte, and the RGBA cut-out when it was asked for.
#[derive(Debug, Clone)]
pub struct GpuMatte {
    pub matte: Matte,
    pub cutout: Option<RgbaImage>,
}

/// A model input stage on the GPU: the resize + normalise buffers for one input size.
struct InputStage {
    spec: ImageInputSpec,
    horizontal: DeviceTaps<i32>,
    vertical: DeviceTaps<i32>,
    tmp: CudaSlice<u8>,
    resized: CudaSlice<u8>,
    max_value: CudaSlice<u32>,
    input: DeviceTensor,
}

impl InputStage {
    fn alloc(
        stream: &Arc<CudaStream>,
        spec: &ImageInputSpec,
        limits: &GpuLimits,
        element: InputElement,
    ) -> Result<Self, CudaError> {
        let (w, h) = (spec.width, spec.height);
        let (outs_h, weights_h) = taps_capacity(limits.max_side_px, w);
        let (outs_v, weights_v) = taps_capacity(limits.max_side_px, h);
        let pixels = w as usize * h as usize;
        Ok(Self {
            spec: spec.clone(),
            horizontal: DeviceTaps::alloc(stream, outs_h, weights_h)?,
            vertical: DeviceTaps::alloc(stream, outs_v, weights_v)?,
            // The horizontal pass covers at most every source row.
            tmp: stream.alloc_zeros(w as usize * limits.max_side_px as usize * 3)?,
            resized: stream.alloc_zeros(pixels * 3)?,
            max_value: stream.alloc_zeros(1)?,
            input: DeviceTensor::alloc(stream, element, pixels * 3)?,
        })
    }

    /// The resize tables for a source of `size` (nothing when already there).
    fn upload_taps(&mut self, stream: &Arc<CudaStream>, size: (u32, u32)) -> Result<(), CudaError> {
        self.horizontal.set_fixed(stream, size.0, self.spec.width)?;
        self.vertical.set_fixed(stream, size.1, self.spec.height)
    }

    /// Resize + normalise `image` (on the device, `size`) into `self.input`.
    fn run(
        &mut self,
        launcher: &Launcher<'_>,
        image: &CudaSlice<u8>,
        size: (u32, u32),
    ) -> Result<(), CudaError> {
        let dst = (self.spec.width, self.spec.height);
        self.upload_taps(launcher.stream, size)?;
        launcher.preprocess(
            image,
            size,
            &self.horizontal,
            &self.vertical,
            dst,
            &self.spec.normalize,
            &mut self.tmp,
            &mut self.resized,
            &mut self.max_value,
            self.input.as_model_input(),
        )
    }
}

/// The matting model and its extra buffers.
struct MattingStage {
    model: GpuModel,
    input: InputStage,
    trimap_input: String,
    output: String,
    trimap_nearest: DeviceNearest,
    trimap_small: CudaSlice<u8>,
    trimap_unit: DeviceTensor,
    host_trimap: PinnedHostSlice<f32>,
    alpha_shape: [usize; 4],
    alpha_small: CudaSlice<f32>,
}

impl MattingStage {
    /// The matting model from `source`, its output shape, and its buffers.
    fn load(
        spec: &PipelineSpec,
        device: &GpuDevice,
        stream: &Arc<CudaStream>,
        source: &ModelSource<'_>,
        (image, trimap_input, output): (&ImageInputSpec, &String, &String),
        limits: &GpuLimits,
    ) -> Result<Self, CudaError> {
        let image_shape = nchw(image, 3);
        let trimap_shape = nchw(image, 1);
        let px = image.width as usize * image.height as usize;
        let (model, alpha_shape) = match source {
            ModelSource::OnnxRuntime { intra_threads } => {
                let mut model = crate::pipeline::load_matting(spec, *intra_threads)?.ok_or(
                    CudaError::Stage {
                        stage: "matting",
                        reason: "the pipeline names no matting model".into(),
                    },
                )?;
                let warm = model.run(
                    &[
                        (image.input.as_str(), image_shape, &vec![0f32; 3 * px]),
                        (trimap_input.as_str(), trimap_shape, &vec![0f32; px]),
                    ],
                    output,
                )?;
                let shape = four_d(&warm, model.label())?;
                (GpuModel::OnnxRuntime(model), shape)
            }
            ModelSource::TensorRt {
                matting: Some(engine),
                ..
            } => {
                let model = TrtModel::new(
                    stream,
                    engine,
                    &engine_label(image),
                    &[
                        (image.input.as_str(), image_shape),
                        (trimap_input.as_str(), trimap_shape),
                    ],
                    output,
                )?;
                let shape = model.output_shape();
                (GpuModel::TensorRt(model), shape)
            }
            ModelSource::TensorRt { matting: None, .. } => {
                return Err(CudaError::Stage {
                    stage: "matting",
                    reason: "the pipeline has a matting model but no engine was given for it"
                        .into(),
                })
            }
        };
        if alpha_shape[1] != 1 {
            return Err(CudaError::Stage {
                stage: "matting",
                reason: format!("expected an alpha of shape [1, 1, H, W], got {alpha_shape:?}"),
            });
        }
        let mut stage = Self {
            input: InputStage::alloc(stream, image, limits, model.input_element(&image.input)?)?,
            trimap_unit: DeviceTensor::alloc(stream, model.input_element(trimap_input)?, px)?,
            model,
            trimap_input: trimap_input.clone(),
            output: output.clone(),
            trimap_nearest: DeviceNearest::alloc(stream, image.width, image.height)?,
            trimap_small: stream.alloc_zeros(px)?,
            host_trimap: pinned(device, px, false)?,
            alpha_small: stream.alloc_zeros(alpha_shape[2] * alpha_shape[3])?,
            alpha_shape,
        };
        if let GpuModel::TensorRt(engine) = &mut stage.model {
            // SAFETY: the buffers are this stage's fields, declared after `model`, so they
            // are freed after it and never reallocated; `GpuPipeline::run` synchronises
            // the stream before writing them again.
            unsafe {
                engine.bind(
                    stream,
                    &[
                        (image.input.as_str(), &stage.input.input),
                        (trimap_input.as_str(), &stage.trimap_unit),
                    ],
                    &stage.alpha_small,
                )?;
            }
        }
        Ok(stage)
    }
}

/// Planes at the source size, and the resize of a small plane up to it (the matting
/// model's alpha; the guided filter works at its own resolution).
struct SourcePlanes {
    image: CudaSlice<u8>,
    trimap: CudaSlice<u8>,
    alpha: CudaSlice<u8>,
    rgba: CudaSlice<u8>,
    p: CudaSlice<f32>,
    plane_tmp: CudaSlice<f32>,
    plane_horizontal: DeviceTaps<f64>,
    plane_vertical: DeviceTaps<f64>,
    nearest: DeviceNearest,
}

/// The segmentation output and what the trimap stage makes of it.
struct MaskStage {
    shape: [usize; 4],
    mask: CudaSlice<f32>,
    lohi: CudaSlice<u32>,
    coarse: CudaSlice<f32>,
    trimap: CudaSlice<u8>,
    flags: CudaSlice<u8>,
    class_values: CudaSlice<u8>,
}

/// Events bracketing the device stages, for per-stage GPU times.
struct StageEvents {
    start: CudaEvent,
    preprocessed: CudaEvent,
    /// The segmentation output is on the device (TensorRT: written there; ONNX Runtime:
    /// uploaded).
    mask_ready: CudaEvent,
    trimapped: CudaEvent,
    matted: CudaEvent,
    composited: CudaEvent,
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

/// One replica of the pipeline on one GPU. Fields drop in order: the models (TensorRT
/// contexts) and buffers before the device, whose context they need.
pub struct GpuPipeline {
    spec: PipelineSpec,
    segmentation: GpuModel,
    seg_input: InputStage,
    mask: MaskStage,
    matting: Option<MattingStage>,
    guided: Option<FastGuidedFilter>,
    planes: SourcePlanes,
    host_upload: Staging,
    host_download: Staging,
    host_input: PinnedHostSlice<f32>,
    events: StageEvents,
    limits: GpuLimits,
    stream: Arc<CudaStream>,
    device: Arc<GpuDevice>,
}

impl Drop for GpuPipeline {
    fn drop(&mut self) {
        // A request that failed half-way may have left kernels, copies or an engine
        // enqueued on the buffers about to be freed: let them finish first.
        let _ = self.stream.synchronize();
    }
}

/// Page-locked staging for a request's one upload or download, grown to the largest
/// request seen and kept. Not sized up front for the largest image the limits allow (9
/// bytes a pixel, up and down: 450 MB per replica at 50 megapixels), and not per request
/// either: pinning is slow (the driver locks every page). Grown only at the start of a
/// request, after the stream is synchronised, so no copy is using the old buffer.
struct Staging {
    context: Arc<CudaContext>,
    write_combined: bool,
    buffer: Option<PinnedHostSlice<u8>>,
}

impl Staging {
    fn new(context: &Arc<CudaContext>, write_combined: bool) -> Self {
        Self {
            context: context.clone(),
            write_combined,
            buffer: None,
        }
    }

    /// The staging, at least `len` bytes (one and a half times the old size when it
    /// grows, so that a run of slightly larger images does not pin each time).
    fn at_least(&mut self, len: usize) -> Result<&mut PinnedHostSlice<u8>, CudaError> {
        let have = self.buffer.as_ref().map_or(0, PinnedHostSlice::len);
        if have < len {
            let grown = len.max(have + have / 2);
            // The old buffer goes first: both at once could pin twice the memory.
            self.buffer = None;
            self.buffer = Some(pinned_with_flags(
                &self.context,
                grown,
                self.write_combined,
            )?);
        }
        match self.buffer.as_mut() {
            Some(buffer) => Ok(buffer),
            None => Err(CudaError::BufferTooSmall {
                what: "pinned staging",
                needed: len,
                capacity: 0,
            }),
        }
    }

    /// Bytes pinned now.
    fn pinned_bytes(&self) -> usize {
        self.buffer.as_ref().map_or(0, PinnedHostSlice::len)
    }
}

fn pinned<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    device: &GpuDevice,
    len: usize,
    write_combined: bool,
) -> Result<PinnedHostSlice<T>, CudaError> {
    pinned_with_flags(device.context(), len, write_combined)
}

/// Page-locked host memory of `len` zeroed bytes (for staging outside `GpuPipeline`).
pub fn pinned_zeroed(
    context: &Arc<CudaContext>,
    len: usize,
) -> Result<PinnedHostSlice<u8>, CudaError> {
    pinned_with_flags(context, len, false)
}

fn pinned_with_flags<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    context: &Arc<CudaContext>,
    len: usize,
    write_combined: bool,
) -> Result<PinnedHostSlice<T>, CudaError> {
    // Write-combined memory is fast for the host to write and the GPU to read, and very
    // slow for the host to read: only for uploads.
    let flags = if write_combined {
        cudarc::driver::sys::CU_MEMHOSTALLOC_WRITECOMBINED
    } else {
        0
    };
    let len = len.max(1);
    // SAFETY: cuMemHostAlloc returns uninitialised memory; it is zeroed through the raw
    // pointer below before any reference to its contents exists.
    let mut buf = unsafe { context.alloc_pinned_with_flags::<T>(len, flags) }?;
    let ptr = buf.as_mut_ptr()?;
    // SAFETY: `ptr` points to `len` elements of T, valid for writes; all-zero bits are a
    // valid T (`ValidAsZeroBits`).
    unsafe { std::ptr::write_bytes(ptr, 0, len) };
    Ok(buf)
}

fn need_len(what: &'static str, len: usize, capacity: usize) -> Result<(), CudaError> {
    if len > capacity {
        return Err(CudaError::BufferTooSmall {
            what,
            needed: len,
            capacity,
        });
    }
    Ok(())
}

/// Checks that a model output is `[1, C, H, W]` of the shape seen at start-up.
fn same_shape(out: &Tensor, expected: &[usize; 4], model: &str) -> Result<(), CudaError> {
    if out.shape.as_slice() != expected || out.data.len() != expected.iter().product::<usize>() {
        return Err(CudaError::Stage {
            stage: "model",
            reason: format!(
                "{model}: output shape {:?} differs from {:?} seen at start-up (the GPU buffers are sized for it)",
                out.shape, expected
            ),
        });
    }
    Ok(())
}

/// `[1, C, H, W]` of a model input.
fn nchw(spec: &ImageInputSpec, channels: usize) -> [usize; 4] {
    [1, channels, spec.height as usize, spec.width as usize]
}

/// An engine's name in errors: its ONNX file's stem.
fn engine_label(spec: &ImageInputSpec) -> String {
    format!(
        "{} (TensorRT)",
        crate::tensorrt::manifest::model_name(&spec.model)
    )
}

fn four_d(out: &Tensor, model: &str) -> Result<[usize; 4], CudaError> {
    match out.shape.as_slice() {
        &[1, c, h, w] if c >= 1 && out.data.len() == c * h * w => Ok([1, c, h, w]),
        shape => Err(CudaError::Stage {
            stage: "model",
            reason: format!("{model}: expected an output of shape [1, C, H, W], got {shape:?}"),
        }),
    }
}

impl GpuPipeline {
    /// Sets up the models of `spec` from `source`, learns their output shapes (from the
    /// engine, or from one warm-up run of ONNX Runtime), and allocates every device and
    /// pinned buffer for images up to `limits`.
    pub fn load(
        spec: &PipelineSpec,
        device: Arc<GpuDevice>,
        source: ModelSource<'_>,
        limits: GpuLimits,
    ) -> Result<Self, CudaError> {
        device.context().bind_to_thread()?;
        let stream = device.new_stream()?;
        let seg = &spec.segmentation;
        let seg_shape = nchw(&seg.image, 3);
        let (mut segmentation, shape) = match &source {
            ModelSource::OnnxRuntime { intra_threads } => {
                let mut model = crate::pipeline::load_segmentation(spec, *intra_threads)?;
                let zeros = vec![0f32; seg_shape.iter().product()];
                let warm = model.run(
                    &[(seg.image.input.as_str(), seg_shape, &zeros)],
                    &seg.output,
                )?;
                let shape = four_d(&warm, model.label())?;
                (GpuModel::OnnxRuntime(model), shape)
            }
            ModelSource::TensorRt { segmentation, .. } => {
                let model = TrtModel::new(
                    &stream,
                    segmentation,
                    &engine_label(&seg.image),
                    &[(seg.image.input.as_str(), seg_shape)],
                    &seg.output,
                )?;
                let shape = model.output_shape();
                (GpuModel::TensorRt(model), shape)
            }
        };
        let seg_input = InputStage::alloc(
            &stream,
            &seg.image,
            &limits,
            segmentation.input_element(&seg.image.input)?,
        )?;
        let plane = shape[2] * shape[3];
        let class_values: Vec<u8> = match &seg.mask {
            MaskKind::Classes { class_values } => class_values.clone(),
            MaskKind::Probability { .. } => vec![0],
        };
        let mut class_buf = stream.alloc_zeros::<u8>(class_values.len().max(1))?;
        stream.memcpy_htod(&class_values, &mut class_buf)?;
        let mask = MaskStage {
            shape,
            mask: stream.alloc_zeros(shape.iter().product::<usize>())?,
            lohi: stream.alloc_zeros(2)?,
            coarse: stream.alloc_zeros(plane)?,
            trimap: stream.alloc_zeros(plane)?,
            flags: stream.alloc_zeros(plane)?,
            class_values: class_buf,
        };
        if let GpuModel::TensorRt(engine) = &mut segmentation {
            // SAFETY: the input and mask buffers become fields of the pipeline, declared
            // after `segmentation`, so they are freed after it and never reallocated;
            // `run` synchronises the stream before writing them again.
            unsafe {
                engine.bind(
                    &stream,
                    &[(seg.image.input.as_str(), &seg_input.input)],
                    &mask.mask,
                )?;
            }
        }

        let max_px = usize::try_from(limits.max_pixels).unwrap_or(usize::MAX);
        let side = limits.max_side_px;
        let matting = match &spec.matting {
            MattingSpec::Model {
                image,
                trimap_input,
                output,
            } => Some(MattingStage::load(
                spec,
                &device,
                &stream,
                &source,
                (image, trimap_input, output),
                &limits,
            )?),
            MattingSpec::GuidedFilter { .. } => None,
        };
        let guided = match &spec.matting {
            &MattingSpec::GuidedFilter {
                radius_px,
                epsilon,
                subsample,
            } => Some(FastGuidedFilter::alloc(
                &stream,
                GuidedParams {
                    radius: radius_px,
                    epsilon,
                    subsample,
                },
                limits.max_pixels,
                side,
                (shape[3] as u32, shape[2] as u32),
            )?),
            MattingSpec::Model { .. } => None,
        };
        // The matting model's alpha resized to the source (unused by the guided filter).
        let (small_w, small_h) = match &matting {
            Some(m) => (m.alpha_shape[3] as u32, m.alpha_shape[2] as u32),
            None => (1, 1),
        };
        let (outs_h, weights_h) = taps_capacity(small_w, side);
        let (outs_v, weights_v) = taps_capacity(small_h, side);
        let model_len = if matting.is_some() { max_px } else { 1 };
        let planes = SourcePlanes {
            image: stream.alloc_zeros(max_px * 3)?,
            trimap: stream.alloc_zeros(max_px)?,
            alpha: stream.alloc_zeros(max_px)?,
            rgba: stream.alloc_zeros(max_px * 4)?,
            p: stream.alloc_zeros(model_len)?,
            plane_tmp: stream.alloc_zeros(side as usize * small_h as usize)?,
            plane_horizontal: DeviceTaps::alloc(&stream, outs_h, weights_h)?,
            plane_vertical: DeviceTaps::alloc(&stream, outs_v, weights_v)?,
            nearest: DeviceNearest::alloc(&stream, side, side)?,
        };
        let event = || device.timing_event();
        let events = StageEvents {
            start: event()?,
            preprocessed: event()?,
            mask_ready: event()?,
            trimapped: event()?,
            matted: event()?,
            composited: event()?,
        };
        // Host staging of model inputs: only ONNX Runtime reads them on the host.
        let input_len = match &source {
            ModelSource::OnnxRuntime { .. } => seg_input
                .input
                .len()
                .max(matting.as_ref().map_or(0, |m| m.input.input.len())),
            ModelSource::TensorRt { .. } => 1,
        };
        let pipeline = Self {
            spec: spec.clone(),
            host_upload: Staging::new(device.context(), true),
            host_download: Staging::new(device.context(), false),
            host_input: pinned(&device, input_len, false)?,
            device,
            stream,
            limits,
            segmentation,
            seg_input,
            mask,
            matting,
            guided,
            planes,
            events,
        };
        pipeline.stream.synchronize()?;
        Ok(pipeline)
    }

    /// Host memory this replica holds page-locked now: the upload and download staging
    /// (grown to the largest request so far) and, with ONNX Runtime models, their input
    /// staging.
    pub fn pinned_host_bytes(&self) -> usize {
        let f32_bytes = std::mem::size_of::<f32>();
        self.host_upload.pinned_bytes()
            + self.host_download.pinned_bytes()
            + self.host_input.len() * f32_bytes
            + self
                .matting
                .as_ref()
                .map_or(0, |m| m.host_trimap.len() * f32_bytes)
    }

    /// "TensorRT" or "ONNX Runtime (CPU)": what runs this replica's models.
    pub fn model_backend(&self) -> &'static str {
        match self.segmentation {
            GpuModel::TensorRt(_) => "TensorRT",
            GpuModel::OnnxRuntime(_) => "ONNX Runtime (CPU)",
        }
    }

    /// Runs every stage between decode and encode on `image`. With `cutout`, the RGBA
    /// cut-out is made on the GPU too. Stage times: wall time for the host parts, GPU
    /// event time for the kernels.
    pub fn run(
        &mut self,
        image: &RgbImage,
        cutout: bool,
        timings: &mut StageTimings,
    ) -> Result<GpuMatte, CudaError> {
        let (w, h) = image.dimensions();
        let pixels = u64::from(w) * u64::from(h);
        if pixels > self.limits.max_pixels || w.max(h) > self.limits.max_side_px || pixels == 0 {
            return Err(CudaError::ImageTooLarge {
                width: w,
                height: h,
                limit: format!(
                    "{} pixels, {} px a side",
                    self.limits.max_pixels, self.limits.max_side_px
                ),
            });
        }
        let n = pixels as usize;
        let wall = Instant::now();
        let stream = self.stream.clone();
        // A request that failed half-way may have left copies from the pinned staging in
        // flight; they must finish before the staging is written again.
        stream.synchronize()?;
        self.upload_tables((w, h))?;
        let device = self.device.clone();
        let kernels = device.kernels();
        let launcher = Launcher {
            stream: &stream,
            kernels,
        };

        // The one upload: through pinned memory, so the copy is a DMA the host need not
        // wait for.
        let raw = image.as_raw();
        let upload = self.host_upload.at_least(raw.len())?;
        upload.as_mut_slice()?[..raw.len()].copy_from_slice(raw);
        self.events.start.record(&stream)?;
        {
            let staged = &upload.as_slice()?[..raw.len()];
            stream.memcpy_htod(staged, &mut self.planes.image)?;
        }
        self.seg_input.run(&launcher, &self.planes.image, (w, h))?;
        self.events.preprocessed.record(&stream)?;

        let seg = &self.spec.segmentation;
        match &mut self.segmentation {
            GpuModel::TensorRt(model) => {
                model.enqueue(&launcher, &mut self.mask.mask)?;
            }
            GpuModel::OnnxRuntime(model) => {
                let input_len = self.seg_input.input.len();
                download(
                    &stream,
                    self.seg_input.input.as_f32()?,
                    input_len,
                    &mut self.host_input,
                )?;
                stream.synchronize()?;
                timings.preprocess = wall.elapsed();
                let t = Instant::now();
                let out = model.run(
                    &[(
                        seg.image.input.as_str(),
                        nchw(&self.seg_input.spec, 3),
                        &self.host_input.as_slice()?[..input_len],
                    )],
                    &seg.output,
                )?;
                same_shape(&out, &self.mask.shape, model.label())?;
                stream.memcpy_htod(&out.data, &mut self.mask.mask)?;
                timings.model = t.elapsed();
            }
        }
        self.events.mask_ready.record(&stream)?;

        // Trimap at the output's resolution, eroded, then NEAREST to the source size.
        let [_, classes, mh, mw] = self.mask.shape;
        let small = (mw as u32, mh as u32);
        match &seg.mask {
            MaskKind::Probability { minmax } => launcher.probability_trimap(
                &self.mask.mask,
                small,
                *minmax,
                self.spec.trimap.foreground,
                self.spec.trimap.background,
                &mut self.mask.lohi,
                &mut self.mask.coarse,
                &mut self.mask.trimap,
            )?,
            MaskKind::Classes { class_values } => {
                if classes != class_values.len() {
                    return Err(CudaError::Stage {
                        stage: "trimap",
                        reason: format!(
                            "the output has {classes} classes, the pipeline description maps {}",
                            class_values.len()
                        ),
                    });
                }
                launcher.classes_trimap(
                    &self.mask.mask,
                    small,
                    classes as u32,
                    &self.mask.class_values,
                    &mut self.mask.coarse,
                    &mut self.mask.trimap,
                )?
            }
        }
        launcher.erode(
            &mut self.mask.trimap,
            small,
            self.spec.trimap.erode_px,
            &mut self.mask.flags,
        )?;
        self.planes.nearest.set(&stream, small, (w, h))?;
        launcher.resize_nearest(
            &self.mask.trimap,
            &self.planes.nearest,
            &mut self.planes.trimap,
        )?;
        self.events.trimapped.record(&stream)?;

        // Matting: the fast guided filter on the GPU (fit at 1/subsample, alpha and
        // cut-out at full size in one pass), or the matting model (TensorRT, or ONNX Runtime on the CPU) and
        // the composite of its alpha.
        let is_guided = match (&self.spec.matting, self.guided.as_mut()) {
            (MattingSpec::GuidedFilter { .. }, Some(filter)) => {
                let p = &mut self.planes;
                filter.fit(&launcher, &p.image, (w, h), &self.mask.coarse, small)?;
                self.events.matted.record(&stream)?;
                filter.alpha(
                    &launcher,
                    &p.image,
                    (w, h),
                    &p.trimap,
                    &mut p.alpha,
                    cutout.then_some(&mut p.rgba),
                )?;
                true
            }
            (MattingSpec::GuidedFilter { .. }, None) => {
                return Err(CudaError::Stage {
                    stage: "matting",
                    reason: "guided filter buffers not allocated".into(),
                })
            }
            (MattingSpec::Model { .. }, _) => {
                let t = Instant::now();
                self.run_matting_model(&launcher, small, (w, h))?;
                // TensorRT's share is taken from the events once the GPU is done.
                if !self.matting_on_gpu() {
                    timings.model += t.elapsed();
                }
                self.events.matted.record(&stream)?;
                let p = &mut self.planes;
                launcher.composite(
                    &p.p,
                    &p.trimap,
                    false,
                    n as u32,
                    &mut p.alpha,
                    cutout.then_some((&p.image, &mut p.rgba)),
                )?;
                false
            }
        };
        self.events.composited.record(&stream)?;

        // The one download: alpha, trimap, cut-out, back to back, then one sync.
        let t = Instant::now();
        let out_len = if cutout { 6 * n } else { 2 * n };
        self.host_download.at_least(out_len)?;
        {
            let p = &self.planes;
            let host = self.host_download.at_least(out_len)?.as_mut_slice()?;
            let (alpha_host, rest) = host.split_at_mut(n);
            let (trimap_host, rest) = rest.split_at_mut(n);
            stream.memcpy_dtoh(&p.alpha.slice(..n), alpha_host)?;
            stream.memcpy_dtoh(&p.trimap.slice(..n), trimap_host)?;
            if cutout {
                stream.memcpy_dtoh(&p.rgba.slice(..4 * n), &mut rest[..4 * n])?;
            }
        }
        stream.synchronize()?;
        let host = self.host_download.at_least(out_len)?.as_slice()?;
        let image_err = |what: &str| CudaError::Stage {
            stage: "download",
            reason: format!("{what} buffer does not match {w}x{h}"),
        };
        let alpha =
            GrayImage::from_raw(w, h, host[..n].to_vec()).ok_or_else(|| image_err("alpha"))?;
        let trimap = GrayImage::from_raw(w, h, host[n..2 * n].to_vec())
            .ok_or_else(|| image_err("trimap"))?;
        let rgba = if cutout {
            Some(
                RgbaImage::from_raw(w, h, host[2 * n..6 * n].to_vec())
                    .ok_or_else(|| image_err("cut-out"))?,
            )
        } else {
            None
        };
        let e = &self.events;
        let ms = |a: &CudaEvent, b: &CudaEvent| -> std::time::Duration {
            a.elapsed_ms(b)
                .map(|v| std::time::Duration::from_secs_f64(f64::from(v.max(0.0)) / 1e3))
                .unwrap_or_default()
        };
        timings.trimap = ms(&e.mask_ready, &e.trimapped);
        if matches!(self.segmentation, GpuModel::TensorRt(_)) {
            // Nothing waited for the GPU before the end: its stages are event times.
            timings.preprocess = ms(&e.start, &e.preprocessed);
            timings.model = ms(&e.preprocessed, &e.mask_ready);
        }
        // The guided filter's alpha pass is its apply step: matting time. The composite
        // of the matting model's alpha is the composite stage's.
        if self.matting_on_gpu() {
            // The matting model with its input resize and its alpha's resize.
            timings.model += ms(&e.trimapped, &e.matted);
        }
        if is_guided {
            timings.matting = ms(&e.trimapped, &e.composited);
            timings.composite = t.elapsed();
        } else {
            timings.composite = ms(&e.matted, &e.composited) + t.elapsed();
        }
        Ok(GpuMatte {
            matte: Matte { alpha, trimap },
            cutout: rgba,
        })
    }

    /// Uploads every resize table this image size needs, while the stream is idle. The
    /// tables come from pageable host memory, whose copies the driver may serialise with
    /// the stream: made mid-request, after an engine is queued, they would wait for it.
    /// The stages' own `set_*` calls then find the tables in place and upload nothing.
    fn upload_tables(&mut self, size: (u32, u32)) -> Result<(), CudaError> {
        let stream = &self.stream;
        self.seg_input.upload_taps(stream, size)?;
        let small = (self.mask.shape[3] as u32, self.mask.shape[2] as u32);
        self.planes.nearest.set(stream, small, size)?;
        if let Some(m) = self.matting.as_mut() {
            m.input.upload_taps(stream, size)?;
            let input = (m.input.spec.width, m.input.spec.height);
            m.trimap_nearest.set(stream, small, input)?;
            let alpha = (m.alpha_shape[3] as u32, m.alpha_shape[2] as u32);
            let p = &mut self.planes;
            p.plane_horizontal
                .set_convolution(stream, alpha.0, size.0)?;
            p.plane_vertical.set_convolution(stream, alpha.1, size.1)?;
        }
        if let Some(filter) = self.guided.as_mut() {
            filter.upload_tables(stream, size, small)?;
        }
        Ok(())
    }

    /// Whether the matting model runs on the GPU (TensorRT).
    fn matting_on_gpu(&self) -> bool {
        matches!(
            self.matting.as_ref().map(|m| &m.model),
            Some(GpuModel::TensorRt(_))
        )
    }

    /// The matting model on the image and the small trimap at its input size, its alpha
    /// uploaded and resized to the source into `planes.p`.
    fn run_matting_model(
        &mut self,
        launcher: &Launcher<'_>,
        small: (u32, u32),
        (w, h): (u32, u32),
    ) -> Result<(), CudaError> {
        let stream = launcher.stream;
        let m = self.matting.as_mut().ok_or(CudaError::Stage {
            stage: "matting",
            reason: "matting model not loaded".into(),
        })?;
        m.input.run(launcher, &self.planes.image, (w, h))?;
        let (iw, ih) = (m.input.spec.width, m.input.spec.height);
        m.trimap_nearest.set(stream, small, (iw, ih))?;
        launcher.resize_nearest(&self.mask.trimap, &m.trimap_nearest, &mut m.trimap_small)?;
        let px = iw * ih;
        launcher.trimap_to_unit(&m.trimap_small, px, m.trimap_unit.as_model_input())?;
        match &mut m.model {
            GpuModel::TensorRt(model) => model.enqueue(launcher, &mut m.alpha_small)?,
            GpuModel::OnnxRuntime(model) => {
                let input_len = 3 * px as usize;
                download(
                    stream,
                    m.input.input.as_f32()?,
                    input_len,
                    &mut self.host_input,
                )?;
                download(
                    stream,
                    m.trimap_unit.as_f32()?,
                    px as usize,
                    &mut m.host_trimap,
                )?;
                stream.synchronize()?;
                let out = model.run(
                    &[
                        (
                            m.input.spec.input.as_str(),
                            nchw(&m.input.spec, 3),
                            &self.host_input.as_slice()?[..input_len],
                        ),
                        (
                            m.trimap_input.as_str(),
                            nchw(&m.input.spec, 1),
                            &m.host_trimap.as_slice()?[..px as usize],
                        ),
                    ],
                    &m.output,
                )?;
                same_shape(&out, &m.alpha_shape, model.label())?;
                stream.memcpy_htod(&out.data, &mut m.alpha_small)?;
            }
        }
        let (aw, ah) = (m.alpha_shape[3] as u32, m.alpha_shape[2] as u32);
        let p = &mut self.planes;
        p.plane_horizontal.set_convolution(stream, aw, w)?;
        p.plane_vertical.set_convolution(stream, ah, h)?;
        launcher.resize_plane(
            &m.alpha_small,
            (aw, ah),
            &p.plane_horizontal,
            &p.plane_vertical,
            &mut p.plane_tmp,
            &mut p.p,
        )
    }
}

/// Queues a copy of the first `len` elements of `src` into pinned `dst`.
fn download<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    src: &CudaSlice<T>,
    len: usize,
    dst: &mut PinnedHostSlice<T>,
) -> Result<(), CudaError> {
    need_len("download source", len, src.len())?;
    need_len("download staging", len, dst.len())?;
    let host = &mut dst.as_mut_slice()?[..len];
    stream.memcpy_dtoh(&src.slice(..len), host)?;
    Ok(())
}

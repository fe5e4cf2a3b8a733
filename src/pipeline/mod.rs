//! The stages of one request and their CPU implementations:
//!
//! ```text
//! bytes -decode-> RGB8 -preprocess-> NCHW f32 -segmentation-> mask -> trimap
//!   -> matting (guided filter or model) -> alpha at source size -composite/encode-> PNG
//! ```
//!
//! A `Pipeline` is one replica's worth of models and scratch buffers: it runs one request
//! at a time and is never shared. Decoding and encoding are separate functions because
//! they run on the blocking pool, not on the replica's thread.

pub mod composite;
pub mod decode;
pub mod encode;
pub mod guided_filter;
pub mod plane;
pub mod preprocess;
pub mod resample;
pub mod trimap;

use std::time::{Duration, Instant};

use fast_image_resize::Resizer;
use image::{ExtendedColorType, GrayImage, RgbImage, RgbaImage};
use serde::Serialize;

use crate::backend::ort::OrtModel;
use crate::backend::{BackendError, Tensor};
use crate::config::{ImageInputSpec, MaskKind, MattingSpec, OutputKind, PipelineSpec};
use plane::Plane;

/// The result of the device stages for one image, at the source size.
#[derive(Debug, Clone)]
pub struct Matte {
    pub alpha: GrayImage,
    pub trimap: GrayImage,
}

/// Wall time of each stage of one request. Zero for a stage that did not run.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StageTimings {
    #[serde(serialize_with = "as_ms")]
    pub decode: Duration,
    #[serde(serialize_with = "as_ms")]
    pub preprocess: Duration,
    #[serde(serialize_with = "as_ms")]
    pub model: Duration,
    #[serde(serialize_with = "as_ms")]
    pub trimap: Duration,
    #[serde(serialize_with = "as_ms")]
    pub matting: Duration,
    #[serde(serialize_with = "as_ms")]
    pub composite: Duration,
    #[serde(serialize_with = "as_ms")]
    pub encode: Duration,
}

fn as_ms<S: serde::Serializer>(d: &Duration, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_f64(d.as_secs_f64() * 1e3)
}

impl StageTimings {
    /// `(name, duration)` for each stage, in pipeline order.
    pub fn stages(&self) -> [(&'static str, Duration); 7] {
        [
            ("decode", self.decode),
            ("preprocess", self.preprocess),
            ("model", self.model),
            ("trimap", self.trimap),
            ("matting", self.matting),
            ("composite", self.composite),
            ("encode", self.encode),
        ]
    }
}

/// Why the device stages failed: the models or their outputs, never the client's input.
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("{stage}: {reason}")]
    Stage { stage: &'static str, reason: String },
}

fn stage_err(stage: &'static str) -> impl Fn(String) -> PipelineError {
    move |reason| PipelineError::Stage { stage, reason }
}

/// One replica: its own sessions (so `run` needs no lock) and reusable buffers.
pub struct Pipeline {
    spec: PipelineSpec,
    segmentation: OrtModel,
    matting: Option<OrtModel>,
    buffers: Buffers,
}

/// Scratch reused from request to request, so the hot path allocates little.
struct Buffers {
    resizer: Resizer,
    resized: Vec<u8>,
    input: Vec<f32>,
    /// The stacked [N, 3, h, w] segmentation input of a batch.
    batch: Vec<f32>,
}

impl Buffers {
    /// Resize + normalise `image` for `spec` into `self.input`.
    fn prepare_input(&mut self, image: &RgbImage, spec: &ImageInputSpec) {
        self.input.resize(input_len(spec), 0.0);
        prepare_into(&mut self.resized, image, spec, &mut self.input);
    }
}

/// The values of one image's `[1, 3, h, w]` model input.
fn input_len(spec: &ImageInputSpec) -> usize {
    batch_of_one(spec, 3).iter().product()
}

/// Resize (into `resized`) + normalise `image` for `spec` into `out`, which holds
/// `input_len(spec)` values: one image's slot of a model input.
fn prepare_into(resized: &mut Vec<u8>, image: &RgbImage, spec: &ImageInputSpec, out: &mut [f32]) {
    preprocess::resize_rgb(image, spec.width, spec.height, resized);
    preprocess::normalize_into(resized, &spec.normalize, out);
}

impl Pipeline {
    /// Loads every model of `spec` with `intra_threads` ONNX Runtime threads each, and
    /// checks that their inputs and outputs are the ones the description names.
    pub fn load(spec: &PipelineSpec, intra_threads: usize) -> Result<Self, BackendError> {
        let segmentation = load_segmentation(spec, intra_threads)?;
        check_batching(&segmentation, spec)?;
        let matting = load_matting(spec, intra_threads)?;
        Ok(Self {
            spec: spec.clone(),
            segmentation,
            matting,
            buffers: Buffers {
                resizer: Resizer::new(),
                resized: Vec::new(),
                input: Vec::new(),
                batch: Vec::new(),
            },
        })
    }

    /// Runs every stage between decode and composite on `image`, recording the time of
    /// each in `timings`: a batch of one.
    pub fn run(
        &mut self,
        image: &RgbImage,
        timings: &mut StageTimings,
    ) -> Result<Matte, PipelineError> {
        self.run_batch(&[image], std::slice::from_mut(timings))?
            .pop()
            .ok_or_else(|| stage_err("batch")("no matte for the image".into()))
    }

    /// The device stages of several images with one segmentation run: each input is
    /// normalised into its slot of one [N, 3, h, w] tensor (`load` checked that the
    /// model's batch dimension is dynamic when N can exceed 1) and the output is split
    /// per image; trimap and matting then run image by image. Each image's
    /// `timings.model` is the whole batch's model time.
    pub fn run_batch(
        &mut self,
        images: &[&RgbImage],
        timings: &mut [StageTimings],
    ) -> Result<Vec<Matte>, PipelineError> {
        if images.len() != timings.len() {
            return Err(PipelineError::Stage {
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
        let buffers = &mut self.buffers;
        buffers.batch.resize(n * per_image, 0.0);
        let slots = buffers.batch.chunks_exact_mut(per_image);
        for ((image, t), slot) in images.iter().zip(timings.iter_mut()).zip(slots) {
            let start = Instant::now();
            prepare_into(&mut buffers.resized, image, &seg.image, slot);
            t.preprocess = start.elapsed();
        }
        let start = Instant::now();
        let [_, c, h, w] = batch_of_one(&seg.image, 3);
        let out = self.segmentation.run(
            &[(seg.image.input.as_str(), [n, c, h, w], &buffers.batch)],
            &seg.output,
        )?;
        let model_time = start.elapsed();
        let per_image = split_batch(out, n)?;
        let mut mattes = Vec::with_capacity(n);
        for ((image, t), out) in images.iter().zip(timings.iter_mut()).zip(per_image) {
            t.model = model_time;
            mattes.push(self.finish(image, &out, t)?);
        }
        Ok(mattes)
    }

    /// Trimap and matting of one image from its segmentation output (batch of one).
    fn finish(
        &mut self,
        image: &RgbImage,
        out: &Tensor,
        timings: &mut StageTimings,
    ) -> Result<Matte, PipelineError> {
        let (width, height) = image.dimensions();
        let seg = &self.spec.segmentation;
        let t = Instant::now();
        let (mut small_trimap, coarse) = match &seg.mask {
            MaskKind::Probability { minmax } => {
                let mask = trimap::probability_mask(out, *minmax).map_err(stage_err("trimap"))?;
                let t = trimap::threshold(
                    &mask,
                    self.spec.trimap.foreground,
                    self.spec.trimap.background,
                );
                (t, mask)
            }
            MaskKind::Classes { class_values } => {
                trimap::classes(out, class_values).map_err(stage_err("trimap"))?
            }
        };
        trimap::erode(&mut small_trimap, self.spec.trimap.erode_px);
        let trimap_full = resample::resize_nearest(&small_trimap, width, height);
        timings.trimap = t.elapsed();

        let t = Instant::now();
        let alpha = match &self.spec.matting {
            &MattingSpec::GuidedFilter {
                radius_px,
                epsilon,
                subsample,
            } => guided_filter::fit(
                &mut self.buffers.resizer,
                image,
                &coarse,
                radius_px,
                epsilon,
                subsample,
            )
            .map_err(stage_err("matting"))?
            .alpha(image, &trimap_full),
            MattingSpec::Model {
                image: spec,
                trimap_input,
                output,
            } => {
                let model = self.matting.as_mut().ok_or_else(|| PipelineError::Stage {
                    stage: "matting",
                    reason: "matting model not loaded".into(),
                })?;
                let alpha = run_matting_model(
                    model,
                    &mut self.buffers,
                    image,
                    &small_trimap,
                    spec,
                    trimap_input,
                    output,
                )?;
                let full = resample::resize_plane(&mut self.buffers.resizer, &alpha, width, height)
                    .map_err(stage_err("matting"))?;
                composite::quantize_alpha(&full)
            }
        };
        timings.matting = t.elapsed();
        Ok(Matte {
            alpha,
            trimap: trimap_full,
        })
    }
}

/// The matting model on the image and the trimap, both at the model's input size.
fn run_matting_model(
    model: &mut OrtModel,
    buffers: &mut Buffers,
    image: &RgbImage,
    small_trimap: &GrayImage,
    spec: &ImageInputSpec,
    trimap_input: &str,
    output: &str,
) -> Result<Plane, PipelineError> {
    buffers.prepare_input(image, spec);
    let trimap = resample::resize_nearest(small_trimap, spec.width, spec.height);
    let trimap: Vec<f32> = trimap
        .as_raw()
        .iter()
        .map(|&v| f32::from(v) / 255.0)
        .collect();
    let out: Tensor = model.run(
        &[
            (spec.input.as_str(), batch_of_one(spec, 3), &buffers.input),
            (trimap_input, batch_of_one(spec, 1), &trimap),
        ],
        output,
    )?;
    match out.shape.as_slice() {
        [1, 1, h, w] => Ok(Plane::new(*w as u32, *h as u32, out.data)),
        shape => Err(PipelineError::Stage {
            stage: "matting",
            reason: format!("expected an alpha of shape [1, 1, H, W], got {shape:?}"),
        }),
    }
}

/// `[batching]` with more than one request per run needs a dynamic batch dimension on the
/// segmentation input; a fixed one (U2NetP's is 1) would fail at the first batch.
fn check_batching(model: &OrtModel, spec: &PipelineSpec) -> Result<(), BackendError> {
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
    Err(BackendError::Mismatch {
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
fn split_batch(out: Tensor, n: usize) -> Result<Vec<Tensor>, PipelineError> {
    if out.shape.first() != Some(&n) || n == 0 || !out.data.len().is_multiple_of(n) {
        return Err(PipelineError::Stage {
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

/// The segmentation model of `spec`, checked against the description's input and output.
pub fn load_segmentation(
    spec: &PipelineSpec,
    intra_threads: usize,
) -> Result<OrtModel, BackendError> {
    let seg = &spec.segmentation;
    let model = OrtModel::load(&seg.image.model, intra_threads)?;
    model.check_io(
        &[(seg.image.input.as_str(), nchw(&seg.image, 3))],
        &seg.output,
    )?;
    Ok(model)
}

/// The matting model of `spec` (`None` with the guided filter), checked against the
/// description's inputs and output.
pub fn load_matting(
    spec: &PipelineSpec,
    intra_threads: usize,
) -> Result<Option<OrtModel>, BackendError> {
    let MattingSpec::Model {
        image,
        trimap_input,
        output,
    } = &spec.matting
    else {
        return Ok(None);
    };
    let model = OrtModel::load(&image.model, intra_threads)?;
    model.check_io(
        &[
            (image.input.as_str(), nchw(image, 3)),
            (trimap_input.as_str(), nchw(image, 1)),
        ],
        output,
    )?;
    Ok(Some(model))
}

fn nchw(spec: &ImageInputSpec, channels: i64) -> [i64; 4] {
    [1, channels, i64::from(spec.height), i64::from(spec.width)]
}

fn batch_of_one(spec: &ImageInputSpec, channels: usize) -> [usize; 4] {
    [1, channels, spec.height as usize, spec.width as usize]
}

/// An encoded response body.
#[derive(Debug, Clone)]
pub struct Rendered {
    pub content_type: &'static str,
    pub body: Vec<u8>,
}

/// Composite and encode `matte` as `kind`. JSON carries every PNG (base64) and the
/// timings, which is why `timings` is updated before the JSON is written.
/// The RGBA cut-out: the device's when it made one (the GPU pipeline), else composited
/// here (timed as the composite stage).
fn cutout_of(
    image: &RgbImage,
    matte: &Matte,
    made: Option<RgbaImage>,
    timings: &mut StageTimings,
) -> RgbaImage {
    match made {
        Some(rgba) if rgba.dimensions() == image.dimensions() => rgba,
        _ => {
            let t = Instant::now();
            let rgba = composite::cutout(image, &matte.alpha);
            timings.composite = t.elapsed();
            rgba
        }
    }
}

pub fn render(
    image: &RgbImage,
    matte: &Matte,
    cutout: Option<RgbaImage>,
    kind: OutputKind,
    timings: &mut StageTimings,
) -> Result<Rendered, PipelineError> {
    let (w, h) = image.dimensions();
    let encode_err = stage_err("encode");
    let gray_png = |g: &GrayImage| encode::png(g.as_raw(), w, h, ExtendedColorType::L8);
    match kind {
        OutputKind::Cutout => {
            let rgba = cutout_of(image, matte, cutout, timings);
            let t = Instant::now();
            let body =
                encode::png(rgba.as_raw(), w, h, ExtendedColorType::Rgba8).map_err(&encode_err)?;
            timings.encode = t.elapsed();
            Ok(Rendered {
                content_type: "image/png",
                body,
            })
        }
        OutputKind::Alpha | OutputKind::Trimap => {
            let t = Instant::now();
            let plane = if kind == OutputKind::Alpha {
                &matte.alpha
            } else {
                &matte.trimap
            };
            let body = gray_png(plane).map_err(&encode_err)?;
            timings.encode = t.elapsed();
            Ok(Rendered {
                content_type: "image/png",
                body,
            })
        }
        OutputKind::Json => {
            use base64::Engine;
            let b64 = |bytes: Vec<u8>| base64::engine::general_purpose::STANDARD.encode(bytes);
            let rgba = cutout_of(image, matte, cutout, timings);
            let t = Instant::now();
            let cutout =
                encode::png(rgba.as_raw(), w, h, ExtendedColorType::Rgba8).map_err(&encode_err)?;
            let alpha = gray_png(&matte.alpha).map_err(&encode_err)?;
            let trimap = gray_png(&matte.trimap).map_err(&encode_err)?;
            timings.encode = t.elapsed();
            let body = serde_json::to_vec(&serde_json::json!({
                "width": w,
                "height": h,
                "cutout_png": b64(cutout),
                "alpha_png": b64(alpha),
                "trimap_png": b64(trimap),
                "timings_ms": timings,
            }))
            .map_err(|e| encode_err(e.to_string()))?;
            Ok(Rendered {
                content_type: "application/json",
                body,
            })
        }
    }
}

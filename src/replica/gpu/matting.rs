//! Matting on the GPU, one way per pipeline: the fast guided filter (fit at 1/subsample
//! of the coarse mask, then alpha and cut-out at full size in one pass), or the matting
//! model (on the image and the trimap at its input size) whose alpha is resized to the
//! source and composited with the trimap's certain pixels.

use std::sync::Arc;

use crate::cuda::driver::{CudaSlice, CudaStream};

use super::buffers::{GpuLimits, SourcePlanes};
use super::clock::{Mark, StageClock};
use super::error::GpuError;
use super::input::InputStage;
use super::mask::MaskStage;
use super::model::{GpuModel, HostRun, ModelSource};
use crate::cuda::guided::{FastGuidedFilter, GuidedParams};
use crate::cuda::launch::{GpuNearest, Launcher};
use crate::cuda::plane_resize::PlaneResize;
use crate::cuda::{CudaError, GpuDevice};
use crate::replica::models;
use crate::spec::{MattingSpec, PipelineSpec};

/// How a GPU replica makes the alpha.
pub enum Matting {
    GuidedFilter(Box<FastGuidedFilter>),
    Model(Box<ModelMatting>),
}

/// The matting model and its buffers.
pub struct ModelMatting {
    input: InputStage,
    model: GpuModel,
    /// The trimap from the mask's resolution to the model's input size.
    trimap_nearest: GpuNearest,
    trimap_small: CudaSlice<u8>,
    /// The model's alpha resized to the source, into `refined`.
    alpha_resize: PlaneResize,
    refined: CudaSlice<f32>,
}

impl Matting {
    /// The pipeline's matting, with buffers for sources up to `limits` and a segmentation
    /// output of `mask_size`.
    pub fn load(
        spec: &PipelineSpec,
        source: &ModelSource<'_>,
        mask_size: (u32, u32),
        limits: &GpuLimits,
        device: &GpuDevice,
        stream: &Arc<CudaStream>,
    ) -> Result<Self, GpuError> {
        let (image, model_spec) = match (&spec.matting, models::matting(spec)) {
            (
                &MattingSpec::GuidedFilter {
                    radius_px,
                    epsilon,
                    subsample,
                },
                _,
            ) => {
                let params = GuidedParams {
                    radius: radius_px,
                    epsilon,
                    subsample,
                };
                let filter = FastGuidedFilter::alloc(
                    stream,
                    params,
                    limits.max_pixels,
                    limits.max_side_px,
                    mask_size,
                )?;
                return Ok(Self::GuidedFilter(Box::new(filter)));
            }
            (MattingSpec::Model { image, .. }, Some(model_spec)) => (image.clone(), model_spec),
            (MattingSpec::Model { .. }, None) => return Err(stage("no matting model described")),
        };
        let (engine, threads) = match source {
            ModelSource::TensorRt {
                matting: Some(engine),
                ..
            } => (Some(*engine), 1),
            ModelSource::TensorRt { matting: None, .. } => {
                return Err(stage(
                    "the pipeline has a matting model but no engine was given for it",
                ))
            }
            ModelSource::OnnxRuntime { intra_threads } => (None, *intra_threads),
        };
        let model = GpuModel::load(&model_spec, engine, threads, device, stream)?;
        let [_, channels, ah, aw] = model.output_shape();
        if channels != 1 {
            return Err(stage(&format!(
                "expected an alpha of shape [1, 1, H, W], got {:?}",
                model.output_shape()
            )));
        }
        let max_px = usize::try_from(limits.max_pixels).unwrap_or(usize::MAX);
        Ok(Self::Model(Box::new(ModelMatting {
            input: InputStage::alloc(stream, &image, limits)?,
            model,
            trimap_nearest: GpuNearest::alloc(stream, image.width, image.height)?,
            trimap_small: stream.alloc_zeros(image.width as usize * image.height as usize)?,
            alpha_resize: PlaneResize::alloc(stream, (aw as u32, ah as u32), limits.max_side_px)?,
            refined: stream.alloc_zeros(max_px)?,
        })))
    }

    /// Every table the matting of a source of `size` needs, made on the device (nothing
    /// when already there).
    pub fn make_tables(
        &mut self,
        launcher: &Launcher<'_>,
        size: (u32, u32),
        mask: &MaskStage,
    ) -> Result<(), CudaError> {
        let mask_size = mask.size();
        match self {
            Self::GuidedFilter(filter) => filter.make_tables(launcher, size, mask_size),
            Self::Model(m) => {
                m.input.make_taps(launcher, size)?;
                m.trimap_nearest.set(launcher, mask_size, m.input.size())?;
                let alpha_size = m.alpha_size();
                m.alpha_resize.set(launcher, alpha_size, size)
            }
        }
    }

    pub fn is_guided(&self) -> bool {
        matches!(self, Self::GuidedFilter(_))
    }

    /// Whether a matting model runs on the GPU (TensorRT), so its time is an event time.
    pub fn model_on_gpu(&self) -> bool {
        matches!(self, Self::Model(m) if m.model.on_gpu())
    }

    /// The alpha of the image in `planes` (`size`) into `planes.alpha`, and with `cutout`
    /// the RGBA cut-out into `planes.rgba`; `Matted` is marked between the matting and the
    /// composite. The host run of an ONNX Runtime matting model, if there was one.
    pub fn run(
        &mut self,
        launcher: &Launcher<'_>,
        planes: &mut SourcePlanes,
        size: (u32, u32),
        mask: &MaskStage,
        cutout: bool,
        clock: &StageClock,
    ) -> Result<Option<HostRun>, GpuError> {
        let stream = launcher.stream;
        let n = size.0 * size.1;
        let p = planes;
        match self {
            Self::GuidedFilter(filter) => {
                filter.fit(launcher, &p.image, size, &mask.coarse, mask.size())?;
                clock.mark(Mark::Matted, stream)?;
                let rgba = cutout.then_some(&mut p.rgba);
                filter.alpha(launcher, &p.image, size, &p.trimap, &mut p.alpha, rgba)?;
                Ok(None)
            }
            Self::Model(m) => {
                let host = m.run_model(launcher, &p.image, size, mask)?;
                clock.mark(Mark::Matted, stream)?;
                let with_rgb = cutout.then_some((&p.image, &mut p.rgba));
                launcher.composite(&m.refined, &p.trimap, false, n, &mut p.alpha, with_rgb)?;
                Ok(host)
            }
        }
    }
}

impl ModelMatting {
    /// `(width, height)` of the model's alpha.
    fn alpha_size(&self) -> (u32, u32) {
        let [_, _, h, w] = self.model.output_shape();
        (w as u32, h as u32)
    }

    /// The model on the image and the mask's trimap at its input size; its alpha resized
    /// to the source into `refined`.
    fn run_model(
        &mut self,
        launcher: &Launcher<'_>,
        image: &CudaSlice<u8>,
        size: (u32, u32),
        mask: &MaskStage,
    ) -> Result<Option<HostRun>, GpuError> {
        self.input
            .run(launcher, image, size, self.model.input(0)?)?;
        let (iw, ih) = self.input.size();
        self.trimap_nearest.set(launcher, mask.size(), (iw, ih))?;
        launcher.resize_nearest(&mask.trimap, &self.trimap_nearest, &mut self.trimap_small)?;
        launcher.trimap_to_unit(&self.trimap_small, iw * ih, self.model.input(1)?)?;
        let host = self.model.run(launcher)?;
        let alpha_size = self.alpha_size();
        self.alpha_resize.run(
            launcher,
            self.model.output(),
            alpha_size,
            size,
            &mut self.refined,
        )?;
        Ok(host)
    }
}

fn stage(reason: &str) -> GpuError {
    GpuError::Cuda(CudaError::Stage {
        stage: "matting",
        reason: reason.to_string(),
    })
}

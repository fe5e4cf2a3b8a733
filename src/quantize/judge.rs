//! Runs candidate models the way a build judges them: the whole CPU pipeline with a
//! candidate as the segmentation model (the gate's alpha), or the candidate alone on
//! prepared inputs (the search's ranking). Candidates are written to the build's work
//! folder, since ONNX Runtime loads models from files.

use std::path::{Path, PathBuf};

use image::GrayImage;

use super::gate::{Gate, GateReport, Judged, NoiseFloor};
use super::images::NamedImage;
use super::model::OnnxModel;
use super::QuantizeError;
use crate::matte::StageTimings;
use crate::ort::session::{OpThreads, OrtModel};
use crate::replica::cpu::CpuStages;
use crate::spec::{ImageInputSpec, MattingSpec, PipelineSpec};

/// The work files of a build, removed when it ends.
pub struct WorkDir(pub PathBuf);

impl WorkDir {
    pub fn create(path: PathBuf) -> Result<Self, QuantizeError> {
        std::fs::create_dir_all(&path).map_err(io_err(&path))?;
        Ok(Self(path))
    }
}

impl Drop for WorkDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn io_err(path: &Path) -> impl Fn(std::io::Error) -> QuantizeError + '_ {
    move |error| QuantizeError::Io {
        path: path.to_path_buf(),
        error,
    }
}

/// A model stage of the pipeline, whose model a candidate replaces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    Segmentation,
    Matting,
}

impl Stage {
    pub fn name(self) -> &'static str {
        match self {
            Stage::Segmentation => "segmentation",
            Stage::Matting => "matting",
        }
    }

    /// The stage's model input in `spec`, if the pipeline runs a model there.
    pub fn image(self, spec: &PipelineSpec) -> Option<&ImageInputSpec> {
        match self {
            Stage::Segmentation => Some(&spec.segmentation.image),
            Stage::Matting => match &spec.matting {
                MattingSpec::Model { image, .. } => Some(image),
                MattingSpec::GuidedFilter { .. } => None,
            },
        }
    }

    fn image_mut(self, spec: &mut PipelineSpec) -> Option<&mut ImageInputSpec> {
        match self {
            Stage::Segmentation => Some(&mut spec.segmentation.image),
            Stage::Matting => match &mut spec.matting {
                MattingSpec::Model { image, .. } => Some(image),
                MattingSpec::GuidedFilter { .. } => None,
            },
        }
    }
}

/// Runs the pipeline (or its segmentation model alone) with candidate models for one
/// stage.
pub struct Judge<'a> {
    pub spec: &'a PipelineSpec,
    pub stage: Stage,
    pub threads: usize,
    pub work: &'a Path,
}

impl Judge<'_> {
    /// The pipeline's alpha of each image with `spec` as it is.
    pub fn alphas_of(
        &self,
        spec: &PipelineSpec,
        images: &[NamedImage],
    ) -> Result<Vec<GrayImage>, QuantizeError> {
        let mut stages = CpuStages::load(spec, self.threads)?;
        images
            .iter()
            .map(|im| {
                let mut t = StageTimings::default();
                Ok(stages.run(&im.rgb, &mut t)?.into_alpha_image())
            })
            .collect()
    }

    /// Writes `model` where ONNX Runtime can load it.
    pub fn candidate_path(&self, model: &OnnxModel) -> Result<PathBuf, QuantizeError> {
        let path = self.work.join("candidate.onnx");
        model.save(&path).map_err(io_err(&path))?;
        Ok(path)
    }

    /// The pipeline's alpha of each image with `model` as the stage's model.
    pub fn alphas(
        &self,
        model: &OnnxModel,
        images: &[NamedImage],
    ) -> Result<Vec<GrayImage>, QuantizeError> {
        let mut spec = self.spec.clone();
        let path = self.candidate_path(model)?;
        let image = self.stage.image_mut(&mut spec).ok_or_else(|| {
            QuantizeError::Unsupported(format!("the pipeline runs no {} model", self.stage.name()))
        })?;
        image.model = path;
        self.alphas_of(&spec, images)
    }

    /// The segmentation output of `model` on each prepared input.
    pub fn outputs(
        &self,
        model: &OnnxModel,
        inputs: &[Vec<f32>],
    ) -> Result<Vec<Vec<f32>>, QuantizeError> {
        let path = self.candidate_path(model)?;
        let mut session = OrtModel::load_uncached(
            &path,
            OpThreads::Own {
                threads: self.threads,
                alone: true,
            },
        )?;
        let seg = &self.spec.segmentation;
        let shape = input_shape(self.spec);
        inputs
            .iter()
            .map(|x| {
                Ok(session
                    .run(&[(seg.image.input.as_str(), shape, x)], &seg.output)?
                    .data)
            })
            .collect()
    }

    /// FP32's alphas of `images`, and of each image moved by one level.
    pub fn reference(&self, images: &[NamedImage]) -> Result<Reference, QuantizeError> {
        let alphas = self.alphas_of(self.spec, images)?;
        let moved: Vec<NamedImage> = images
            .iter()
            .map(|im| NamedImage {
                name: im.name.clone(),
                rgb: moved_one_level(&im.rgb),
            })
            .collect();
        let moved_alphas = self.alphas_of(self.spec, &moved)?;
        let floors = alphas
            .iter()
            .zip(&moved_alphas)
            .map(|(a, m)| Gate::noise_floor(a, m))
            .collect();
        Ok(Reference { alphas, floors })
    }

    /// The gate's verdict on `model` over `images`, images the build has not chosen on:
    /// the report when it passes, `GateFailed` with it otherwise.
    pub fn verdict(
        &self,
        gate: &Gate,
        images: &[NamedImage],
        model: &OnnxModel,
    ) -> Result<GateReport, QuantizeError> {
        let reference = self.reference(images)?;
        let report = judge(gate, images, &reference, &self.alphas(model, images)?);
        if report.passed {
            Ok(report)
        } else {
            Err(QuantizeError::GateFailed {
                report: Box::new(report),
            })
        }
    }
}

/// The segmentation model's input shape for one image.
pub fn input_shape(spec: &PipelineSpec) -> [usize; 4] {
    let image = &spec.segmentation.image;
    [1, 3, image.height as usize, image.width as usize]
}

/// FP32's alphas of a set of images, and its noise floor on each.
pub struct Reference {
    pub alphas: Vec<GrayImage>,
    pub floors: Vec<NoiseFloor>,
}

impl Reference {
    /// Whether FP32 agrees with itself on image `i` within `gate`.
    pub fn stable(&self, gate: &Gate, i: usize) -> bool {
        self.floors.get(i).is_some_and(|f| gate.admits(f))
    }
}

/// `image` with each value moved by -1, 0 or +1 (clamped), the same for the same image
/// every time: a change no one can see, and so one no variant should be judged beside.
fn moved_one_level(image: &image::RgbImage) -> image::RgbImage {
    let mut out = image.clone();
    let mut state = 0x9e37_79b9_7f4a_7c15_u64;
    for v in out.iter_mut() {
        // xorshift64: cheap, and fixed by its seed.
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        *v = match state % 3 {
            0 => v.saturating_sub(1),
            1 => *v,
            _ => v.saturating_add(1),
        };
    }
    out
}

/// `gate`'s verdict on `variant`'s alphas against FP32's, image by image.
pub fn judge(
    gate: &Gate,
    images: &[NamedImage],
    reference: &Reference,
    variant: &[GrayImage],
) -> GateReport {
    gate.judge(
        images
            .iter()
            .enumerate()
            .zip(reference.alphas.iter().zip(variant))
            .map(|((i, im), (r, v))| Judged {
                name: im.name.as_str(),
                reference: r,
                variant: v,
                noise_floor: reference.floors.get(i).copied(),
            }),
    )
}

/// The mean |a - b| over every value of every pair of outputs.
pub fn mean_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    let (mut sum, mut n) = (0f64, 0usize);
    for (x, y) in a.iter().zip(b) {
        for (p, q) in x.iter().zip(y) {
            sum += f64::from((p - q).abs());
            n += 1;
        }
    }
    sum / n.max(1) as f64
}

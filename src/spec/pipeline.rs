//! The pipeline description, `celer.toml` in a model directory: which models run, how
//! their inputs are normalised, what their outputs mean. Parsing is two steps: serde reads
//! the raw file (unknown keys are errors), then `validate` turns it into the typed spec
//! the pipeline uses. Every error names the file, the key and what was expected.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use super::SpecError;

/// The file name looked for in a model directory.
pub const PIPELINE_FILE: &str = "celer.toml";

/// The key of the segmentation model in [`PipelineSpec::model_keys`] (its celer.toml key).
pub const SEGMENTATION_MODEL: &str = "segmentation.model";
/// The key of the matting model in [`PipelineSpec::model_keys`].
pub const MATTING_MODEL: &str = "matting.model";

/// A validated pipeline description.
#[derive(Debug, Clone, PartialEq)]
pub struct PipelineSpec {
    /// The `celer.toml` this came from (for messages).
    pub source: PathBuf,
    pub segmentation: SegmentationSpec,
    pub trimap: TrimapSpec,
    pub matting: MattingSpec,
    pub default_output: OutputKind,
    pub batching: BatchingSpec,
}

/// One model input fed with the (resized, normalised) image.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageInputSpec {
    /// Absolute or model-dir-relative path resolved against the toml's folder.
    pub model: PathBuf,
    pub input: String,
    pub width: u32,
    pub height: u32,
    pub normalize: Normalize,
    /// The precision `celer build` makes this model in (`precision = "int8"` in its
    /// table; FP32 by default). Serving reads the variants' manifests, not this.
    pub precision: ModelPrecision,
}

/// The precision of a model stage's ONNX file: the published FP32 model, or a variant
/// `celer build` converts (FP16) or calibrates (INT8) and holds to the quality gate.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum ModelPrecision {
    #[default]
    Fp32,
    Fp16,
    Int8,
}

impl ModelPrecision {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Fp32 => "fp32",
            Self::Fp16 => "fp16",
            Self::Int8 => "int8",
        }
    }
}

impl std::fmt::Display for ModelPrecision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ModelPrecision {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "fp32" | "float32" => Ok(Self::Fp32),
            "fp16" | "float16" | "half" => Ok(Self::Fp16),
            "int8" => Ok(Self::Int8),
            other => Err(format!("`{other}`: the precision is fp32, fp16 or int8")),
        }
    }
}

/// `x = (v * s - mean[c]) / std[c]` for each u8 value `v` of channel `c`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Normalize {
    pub scale: Scale,
    pub mean: [f32; 3],
    pub std: [f32; 3],
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Scale {
    /// `s = 1 / max` over every value of the resized image (rembg's U2Net family).
    ImageMax,
    Fixed(f32),
}

#[derive(Debug, Clone, PartialEq)]
pub struct SegmentationSpec {
    pub image: ImageInputSpec,
    pub output: String,
    pub mask: MaskKind,
}

#[derive(Debug, Clone, PartialEq)]
pub enum MaskKind {
    /// Channel 0 is a foreground probability; `minmax` rescales it to [0, 1] per image.
    Probability { minmax: bool },
    /// N-class scores; argmax picks the class, `class_values[c]` is its trimap value.
    Classes { class_values: Vec<u8> },
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TrimapSpec {
    /// Probability at or above which a pixel is certain foreground.
    pub foreground: f32,
    /// Probability at or below which a pixel is certain background.
    pub background: f32,
    /// Erosion of both certain regions, in segmentation-output pixels: the width of the
    /// unknown band that matting resolves.
    pub erode_px: u32,
}

#[derive(Debug, Clone, PartialEq)]
pub enum MattingSpec {
    /// He et al.'s guided filter of the coarse mask, guided by the image's luma, with
    /// its coefficients fitted at 1/`subsample` of the source size (1: the classic filter).
    GuidedFilter {
        radius_px: u32,
        epsilon: f32,
        subsample: u32,
    },
    /// A matting model on image + trimap.
    Model {
        image: ImageInputSpec,
        trimap_input: String,
        output: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OutputKind {
    /// RGBA PNG: the source pixels with alpha.
    Cutout,
    /// Grayscale PNG of alpha.
    Alpha,
    /// Grayscale PNG of the trimap (0, 128, 255).
    Trimap,
    /// JSON with base64 PNGs and per-stage timings.
    Json,
}

impl OutputKind {
    /// Whether the answer shows the RGBA cut-out: the device then makes it (the GPU before
    /// its one download), decided here once for every device.
    pub fn needs_cutout(self) -> bool {
        matches!(self, Self::Cutout | Self::Json)
    }

    /// The word that names it (`cutout`, `alpha`, `trimap`, `json`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Cutout => "cutout",
            Self::Alpha => "alpha",
            Self::Trimap => "trimap",
            Self::Json => "json",
        }
    }

    pub fn parse(word: &str) -> Option<Self> {
        match word.trim().to_ascii_lowercase().as_str() {
            "cutout" | "rgba" => Some(Self::Cutout),
            "alpha" | "mask" => Some(Self::Alpha),
            "trimap" => Some(Self::Trimap),
            "json" => Some(Self::Json),
            _ => None,
        }
    }
}

/// A word that names no output kind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}` is not one of cutout, alpha, trimap, json")]
pub struct UnknownOutputKind(pub String);

impl std::str::FromStr for OutputKind {
    type Err = UnknownOutputKind;

    /// As [`OutputKind::parse`], with the message every caller gives.
    fn from_str(word: &str) -> Result<Self, UnknownOutputKind> {
        Self::parse(word).ok_or_else(|| UnknownOutputKind(word.to_string()))
    }
}

// ---- the raw file ----

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawPipeline {
    segmentation: RawSegmentation,
    #[serde(default)]
    trimap: RawTrimap,
    #[serde(default)]
    matting: RawMatting,
    #[serde(default)]
    output: RawOutput,
    batching: Option<RawBatching>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawBatching {
    max_batch: usize,
    #[serde(default)]
    max_wait_us: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawSegmentation {
    model: PathBuf,
    input: String,
    output: String,
    width: u32,
    height: u32,
    normalize: RawNormalize,
    mask: RawMask,
    precision: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawNormalize {
    scale: RawScale,
    #[serde(default = "zeros")]
    mean: [f32; 3],
    #[serde(default = "ones")]
    std: [f32; 3],
}

fn zeros() -> [f32; 3] {
    [0.0; 3]
}
fn ones() -> [f32; 3] {
    [1.0; 3]
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum RawScale {
    Word(String),
    Number(f64),
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMask {
    kind: String,
    #[serde(default)]
    minmax: bool,
    class_values: Option<Vec<u8>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawTrimap {
    foreground: f32,
    background: f32,
    erode_px: u32,
}

impl Default for RawTrimap {
    fn default() -> Self {
        Self {
            foreground: 0.94,
            background: 0.04,
            erode_px: 2,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawMatting {
    kind: String,
    radius_px: Option<u32>,
    epsilon: Option<f32>,
    subsample: Option<u32>,
    model: Option<PathBuf>,
    image_input: Option<String>,
    trimap_input: Option<String>,
    output: Option<String>,
    width: Option<u32>,
    height: Option<u32>,
    normalize: Option<RawNormalize>,
    precision: Option<String>,
}

impl Default for RawMatting {
    fn default() -> Self {
        Self {
            kind: "guided-filter".into(),
            radius_px: None,
            epsilon: None,
            subsample: None,
            model: None,
            image_input: None,
            trimap_input: None,
            output: None,
            width: None,
            height: None,
            normalize: None,
            precision: None,
        }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawOutput {
    default: OutputKind,
}

impl Default for RawOutput {
    fn default() -> Self {
        Self {
            default: OutputKind::Cutout,
        }
    }
}

/// Beyond these a typo would hold requests for seconds or allocate batches of gigabytes.
const MAX_BATCH: usize = 64;
const MAX_BATCH_WAIT_US: u64 = 100_000;

/// The largest model input side accepted: beyond it a typo (e.g. 32000) would allocate
/// gigabytes per replica.
const MAX_MODEL_SIDE: u32 = 8192;

impl PipelineSpec {
    /// Reads `<dir>/celer.toml`.
    pub fn load_dir(dir: &Path) -> Result<Self, SpecError> {
        Self::load_file(&dir.join(PIPELINE_FILE))
    }

    pub fn load_file(path: &Path) -> Result<Self, SpecError> {
        let text = std::fs::read_to_string(path).map_err(|e| SpecError::Read {
            file: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        Self::parse(&text, path)
    }

    /// Parses and validates `text` as if read from `path` (model paths resolve against
    /// its folder; the models themselves are not opened here).
    pub fn parse(text: &str, path: &Path) -> Result<Self, SpecError> {
        let raw: RawPipeline = toml::from_str(text).map_err(|e| SpecError::Parse {
            file: path.to_path_buf(),
            message: e.message().to_string(),
            key: None,
            line: e.span().map(|s| line_of(text, s.start)),
        })?;
        let base = path.parent().unwrap_or(Path::new("."));
        let invalid = |key: &str, expected: String| SpecError::Invalid {
            file: path.to_path_buf(),
            key: key.to_string(),
            expected,
        };
        let seg = raw.segmentation;
        let image = image_input(
            "segmentation",
            base,
            seg.model,
            seg.input,
            seg.width,
            seg.height,
            seg.normalize,
            seg.precision,
            &invalid,
        )?;
        let mask = match seg.mask.kind.as_str() {
            "probability" => {
                if seg.mask.class_values.is_some() {
                    return Err(invalid(
                        "segmentation.mask.class_values",
                        "no class_values with kind = \"probability\"".into(),
                    ));
                }
                MaskKind::Probability {
                    minmax: seg.mask.minmax,
                }
            }
            "classes" => {
                let class_values = seg.mask.class_values.unwrap_or_else(|| vec![0, 128, 255]);
                if class_values.len() < 2 {
                    return Err(invalid(
                        "segmentation.mask.class_values",
                        "at least two classes (a trimap value 0-255 per class index)".into(),
                    ));
                }
                MaskKind::Classes { class_values }
            }
            other => {
                return Err(invalid(
                    "segmentation.mask.kind",
                    format!("\"probability\" or \"classes\", found \"{other}\""),
                ))
            }
        };
        let t = raw.trimap;
        if !(0.0..=1.0).contains(&t.background)
            || !(0.0..=1.0).contains(&t.foreground)
            || t.background >= t.foreground
        {
            return Err(invalid(
                "trimap",
                format!(
                    "0 <= background < foreground <= 1, found background = {} and foreground = {}",
                    t.background, t.foreground
                ),
            ));
        }
        if t.erode_px > 64 {
            return Err(invalid(
                "trimap.erode_px",
                format!(
                    "at most 64 (segmentation-output pixels), found {}",
                    t.erode_px
                ),
            ));
        }
        let trimap = TrimapSpec {
            foreground: t.foreground,
            background: t.background,
            erode_px: t.erode_px,
        };
        let matting = matting(raw.matting, base, &invalid)?;
        let batching = match raw.batching {
            None => BatchingSpec::OFF,
            Some(b) => {
                if !(1..=MAX_BATCH).contains(&b.max_batch) {
                    return Err(invalid(
                        "batching.max_batch",
                        format!("1 (off) to {MAX_BATCH}, found {}", b.max_batch),
                    ));
                }
                if b.max_wait_us > MAX_BATCH_WAIT_US {
                    return Err(invalid(
                        "batching.max_wait_us",
                        format!(
                            "at most {MAX_BATCH_WAIT_US} microseconds, found {}",
                            b.max_wait_us
                        ),
                    ));
                }
                BatchingSpec {
                    max_batch: b.max_batch,
                    max_wait_us: b.max_wait_us,
                }
            }
        };
        Ok(Self {
            source: path.to_path_buf(),
            segmentation: SegmentationSpec {
                image,
                output: seg.output,
                mask,
            },
            trimap,
            matting,
            default_output: raw.output.default,
            batching,
        })
    }

    /// Every model file the pipeline runs, in stage order, with its key
    /// ([`SEGMENTATION_MODEL`], [`MATTING_MODEL`]).
    pub fn model_keys(&self) -> Vec<(&'static str, &Path)> {
        let mut paths = vec![(SEGMENTATION_MODEL, self.segmentation.image.model.as_path())];
        if let MattingSpec::Model { image, .. } = &self.matting {
            paths.push((MATTING_MODEL, image.model.as_path()));
        }
        paths
    }
}

fn matting(
    m: RawMatting,
    base: &Path,
    invalid: &dyn Fn(&str, String) -> SpecError,
) -> Result<MattingSpec, SpecError> {
    match m.kind.as_str() {
        "guided-filter" => {
            if m.model.is_some() {
                return Err(invalid(
                    "matting.model",
                    "no model with kind = \"guided-filter\" (set kind = \"model\")".into(),
                ));
            }
            if m.precision.is_some() {
                return Err(invalid(
                    "matting.precision",
                    "no precision with kind = \"guided-filter\": it runs no model".into(),
                ));
            }
            let radius_px = m.radius_px.unwrap_or(8);
            let epsilon = m.epsilon.unwrap_or(1e-3);
            if radius_px == 0 || radius_px > 256 {
                return Err(invalid(
                    "matting.radius_px",
                    format!("1 to 256, found {radius_px}"),
                ));
            }
            if !(epsilon > 0.0 && epsilon.is_finite()) {
                return Err(invalid(
                    "matting.epsilon",
                    format!("a positive number, found {epsilon}"),
                ));
            }
            let subsample = m.subsample.unwrap_or(1);
            if !(1..=16).contains(&subsample) {
                return Err(invalid(
                    "matting.subsample",
                    format!("1 (classic) to 16, found {subsample}"),
                ));
            }
            Ok(MattingSpec::GuidedFilter {
                radius_px,
                epsilon,
                subsample,
            })
        }
        "model" => {
            let need = |v: Option<String>, key: &str| {
                v.ok_or_else(|| {
                    invalid(key, "a tensor name (required with kind = \"model\")".into())
                })
            };
            let model = m.model.ok_or_else(|| {
                invalid(
                    "matting.model",
                    "an ONNX file path (required with kind = \"model\")".into(),
                )
            })?;
            let image_name = need(m.image_input, "matting.image_input")?;
            let trimap_input = need(m.trimap_input, "matting.trimap_input")?;
            let output = need(m.output, "matting.output")?;
            let (Some(width), Some(height)) = (m.width, m.height) else {
                return Err(invalid(
                    "matting.width",
                    "width and height of the matting model's input".into(),
                ));
            };
            let normalize = m.normalize.ok_or_else(|| {
                invalid(
                    "matting.normalize",
                    "a table with scale, mean and std".into(),
                )
            })?;
            let image = image_input(
                "matting",
                base,
                model,
                image_name,
                width,
                height,
                normalize,
                m.precision,
                invalid,
            )?;
            Ok(MattingSpec::Model {
                image,
                trimap_input,
                output,
            })
        }
        other => Err(invalid(
            "matting.kind",
            format!("\"guided-filter\" or \"model\", found \"{other}\""),
        )),
    }
}

#[allow(clippy::too_many_arguments)]
fn image_input(
    table: &str,
    base: &Path,
    model: PathBuf,
    input: String,
    width: u32,
    height: u32,
    normalize: RawNormalize,
    precision: Option<String>,
    invalid: &dyn Fn(&str, String) -> SpecError,
) -> Result<ImageInputSpec, SpecError> {
    let precision = match precision {
        None => ModelPrecision::Fp32,
        Some(word) => word
            .parse()
            .map_err(|e: String| invalid(&format!("{table}.precision"), e))?,
    };
    for (key, side) in [("width", width), ("height", height)] {
        if side == 0 || side > MAX_MODEL_SIDE {
            return Err(invalid(
                &format!("{table}.{key}"),
                format!("1 to {MAX_MODEL_SIDE} pixels, found {side}"),
            ));
        }
    }
    let scale = match normalize.scale {
        RawScale::Word(w) if w == "max" => Scale::ImageMax,
        RawScale::Number(n) if n.is_finite() && n > 0.0 => Scale::Fixed(n as f32),
        RawScale::Word(w) => {
            return Err(invalid(
                &format!("{table}.normalize.scale"),
                format!("\"max\" or a positive number, found \"{w}\""),
            ))
        }
        RawScale::Number(n) => {
            return Err(invalid(
                &format!("{table}.normalize.scale"),
                format!("\"max\" or a positive number, found {n}"),
            ))
        }
    };
    if normalize.std.iter().any(|s| !(s.is_finite() && *s != 0.0)) {
        return Err(invalid(
            &format!("{table}.normalize.std"),
            format!("three non-zero numbers, found {:?}", normalize.std),
        ));
    }
    let model = if model.is_absolute() {
        model
    } else {
        base.join(model)
    };
    Ok(ImageInputSpec {
        model,
        input,
        width,
        height,
        normalize: Normalize {
            scale,
            mean: normalize.mean,
            std: normalize.std,
        },
        precision,
    })
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset.min(text.len())].matches('\n').count() + 1
}

/// `[batching]`: how a device may group requests into one model run. Allowed only when
/// the segmentation model's input has a dynamic batch dimension, which only loading the
/// model can tell: the CPU replica checks it when it loads (`replica::cpu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchingSpec {
    /// Requests per model run; 1 turns batching off.
    pub max_batch: usize,
    /// How long a replica that already holds two or more requests waits for more before
    /// it runs them. A lone request on an idle device never waits.
    pub max_wait_us: u64,
}

impl BatchingSpec {
    pub const OFF: Self = Self {
        max_batch: 1,
        max_wait_us: 0,
    };
}

impl Default for BatchingSpec {
    fn default() -> Self {
        Self::OFF
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const U2NETP: &str = include_str!("../../onnx/u2netp/celer.toml");

    fn parse(text: &str) -> Result<PipelineSpec, SpecError> {
        PipelineSpec::parse(text, Path::new("/models/x/celer.toml"))
    }

    #[test]
    fn u2netp_description_parses() {
        let spec = parse(U2NETP).unwrap();
        assert_eq!(spec.segmentation.image.width, 320);
        assert_eq!(
            spec.segmentation.image.model,
            Path::new("/models/x/u2netp.onnx")
        );
        assert_eq!(spec.segmentation.image.normalize.scale, Scale::ImageMax);
        assert_eq!(
            spec.segmentation.mask,
            MaskKind::Probability { minmax: true }
        );
        assert_eq!(
            spec.matting,
            MattingSpec::GuidedFilter {
                radius_px: 8,
                epsilon: 0.001,
                subsample: 4
            }
        );
        assert_eq!(spec.default_output, OutputKind::Cutout);
    }

    #[test]
    fn error_names_file_key_and_expectation() {
        let text = U2NETP.replace("kind = \"probability\"", "kind = \"heatmap\"");
        let msg = parse(&text).unwrap_err().to_string();
        assert!(msg.contains("/models/x/celer.toml"), "{msg}");
        assert!(msg.contains("segmentation.mask.kind"), "{msg}");
        assert!(msg.contains("\"probability\" or \"classes\""), "{msg}");
    }

    #[test]
    fn unknown_key_is_an_error_with_its_line() {
        let text = U2NETP.replace("erode_px = 2", "erode_pixels = 2");
        let msg = parse(&text).unwrap_err().to_string();
        assert!(msg.contains("erode_pixels"), "{msg}");
        assert!(msg.contains("line"), "{msg}");
    }

    #[test]
    fn wrong_length_mean_is_rejected() {
        let text = U2NETP.replace("mean = [0.485, 0.456, 0.406]", "mean = [0.5, 0.5]");
        let msg = parse(&text).unwrap_err().to_string();
        assert!(msg.contains("length 3"), "{msg}");
    }

    #[test]
    fn thresholds_must_be_ordered() {
        let text = U2NETP.replace("background = 0.04", "background = 0.97");
        let msg = parse(&text).unwrap_err().to_string();
        assert!(msg.contains("key `trimap`"), "{msg}");
    }

    #[test]
    fn matting_model_needs_its_inputs() {
        let text = U2NETP.replace(
            "kind = \"guided-filter\"\nradius_px = 8\nepsilon = 0.001",
            "kind = \"model\"\nmodel = \"m.onnx\"",
        );
        let msg = parse(&text).unwrap_err().to_string();
        assert!(msg.contains("matting.image_input"), "{msg}");
    }

    #[test]
    fn batching_is_off_unless_configured_and_bounded() {
        assert_eq!(parse(U2NETP).unwrap().batching, BatchingSpec::OFF);
        let on = format!("{U2NETP}\n[batching]\nmax_batch = 4\nmax_wait_us = 2000\n");
        assert_eq!(
            parse(&on).unwrap().batching,
            BatchingSpec {
                max_batch: 4,
                max_wait_us: 2000
            }
        );
        let zero = format!("{U2NETP}\n[batching]\nmax_batch = 0\n");
        let msg = parse(&zero).unwrap_err().to_string();
        assert!(msg.contains("batching.max_batch"), "{msg}");
        let slow = format!("{U2NETP}\n[batching]\nmax_batch = 2\nmax_wait_us = 5000000\n");
        let msg = parse(&slow).unwrap_err().to_string();
        assert!(msg.contains("batching.max_wait_us"), "{msg}");
    }

    #[test]
    fn bad_scale_word_is_rejected() {
        let text = U2NETP.replace("scale = \"max\"", "scale = \"maximum\"");
        let msg = parse(&text).unwrap_err().to_string();
        assert!(msg.contains("segmentation.normalize.scale"), "{msg}");
    }
}

//! Reduced-precision variants on disk, and which file each device serves. A variant is
//! an ONNX file with a manifest beside it, under `<engines>/<model>/<precision>/`: what it
//! was made from (the FP32 file's sha256), how (precision, calibration method and
//! images, the convolutions kept in FP32) and what the gate measured. `serve` and `run`
//! use a variant only when its manifest says it passed its gate, its source is the model
//! file the pipeline names today, and its file is the one the manifest hashed; anything
//! else serves FP32, with the reason logged.
//!
//! The CPU serves the INT8 variant (ONNX Runtime's 8-bit kernels; its FP16 runs slower
//! than FP32 there); a GPU serves the FP16 one (TensorRT builds its engines from it). The
//! INT8 variant is ONNX Runtime's asymmetric form, which TensorRT does not take.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::gate::GateReport;
use super::model::OnnxModel;
use super::ranges::Method;
use super::weights::{Int8Products, WeightBits};
use crate::engines::manifest::{model_name, sha256_file};
use crate::spec::{ImageInputSpec, MattingSpec, ModelPrecision, PipelineSpec};

/// The manifest's file name, next to the variant.
pub const VARIANT_MANIFEST: &str = "variant.json";
/// Bumped when a field changes meaning; a manifest of another format is not used.
pub const VARIANT_FORMAT: u32 = 1;

/// A convolution kept in FP32 by the search, and why (`quantize::search`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KeptNode {
    pub node: String,
    /// The model output's mean |difference| from FP32 with this convolution alone
    /// quantized, on calibration images.
    pub sensitivity: f64,
    /// Its share of the model's estimated cost (multiply-adds and values crossing between
    /// 8 bits and float).
    pub cost_share: f64,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    pub method: Method,
    pub images: Vec<String>,
}

/// What a variant is and how it measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct VariantManifest {
    pub format: u32,
    pub model: String,
    pub precision: ModelPrecision,
    /// The FP32 ONNX file, relative to the model directory, and its sha256.
    pub source_file: String,
    pub source_sha256: String,
    /// The variant's file, next to the manifest, and its sha256.
    pub variant_file: String,
    pub variant_sha256: String,
    /// INT8: the images and method the activations' ranges came from.
    pub calibration: Option<Calibration>,
    pub opset_from: u64,
    pub opset_to: u64,
    /// INT8: the convolutions that run in 8 bits, and those the search kept in FP32.
    pub quantized_nodes: usize,
    pub kept_fp32: Vec<KeptNode>,
    /// INT8: the exact graph rewrites made for the CPU's kernels, one line per node
    /// (`quantize::one_channel`, `quantize::pad_channels`). Absent in variants made before
    /// them, which a build makes again rather than keeps (they still serve).
    #[serde(default)]
    pub rewrites: Option<Vec<String>>,
    /// INT8: the weights' width (`quantize::weights`); absent in INT8 variants made
    /// before it, which hold 8-bit weights.
    #[serde(default)]
    pub weights: Option<WeightBits>,
    /// The gate's figures on the validation images; absent, the variant is not served.
    pub gate: Option<GateReport>,
    /// The same figures on the calibration images, for the record (the search judged
    /// candidates on their overall figures).
    #[serde(default)]
    pub calibration_figures: Option<GateReport>,
    pub celer_version: String,
    pub built_at_unix_s: u64,
}

impl VariantManifest {
    /// Reads the manifest in `dir`, if there is one.
    pub fn read(dir: &Path) -> Result<Option<Self>, String> {
        let path = dir.join(VARIANT_MANIFEST);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes)
                .map(Some)
                .map_err(|e| format!("{}: {e}", path.display())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("{}: {e}", path.display())),
        }
    }

    /// Writes it into `dir`, whole or not at all.
    pub fn write(&self, dir: &Path) -> std::io::Result<PathBuf> {
        let path = dir.join(VARIANT_MANIFEST);
        let text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        crate::host::atomic_write::write_atomically(&path, format!("{text}\n").as_bytes())?;
        Ok(path)
    }
}

/// What a build hands over to be written: the model and what it measured.
pub struct NewVariant<'a> {
    pub model: &'a OnnxModel,
    pub precision: ModelPrecision,
    /// The FP32 file it was made from, and the model directory manifests are relative to.
    pub source: &'a Path,
    pub model_dir: &'a Path,
    pub calibration: Option<Calibration>,
    pub opset: (u64, u64),
    pub quantized_nodes: usize,
    pub kept_fp32: Vec<KeptNode>,
    pub rewrites: Option<Vec<String>>,
    pub weights: Option<WeightBits>,
    pub gate: GateReport,
    pub calibration_figures: Option<GateReport>,
}

impl NewVariant<'_> {
    /// Writes the model as `<model>.<precision>.onnx` in `dir`, then its manifest (the
    /// manifest last: a folder with a file but no manifest serves nothing).
    pub fn write(self, dir: &Path) -> std::io::Result<VariantManifest> {
        let name = model_name(self.source);
        let variant_file = format!("{name}.{}.onnx", self.precision);
        let variant_path = dir.join(&variant_file);
        self.model.save(&variant_path)?;
        let manifest = VariantManifest {
            format: VARIANT_FORMAT,
            model: name,
            precision: self.precision,
            source_file: self
                .source
                .strip_prefix(self.model_dir)
                .unwrap_or(self.source)
                .display()
                .to_string(),
            source_sha256: sha256_file(self.source)?,
            variant_file,
            variant_sha256: sha256_file(&variant_path)?,
            calibration: self.calibration,
            opset_from: self.opset.0,
            opset_to: self.opset.1,
            quantized_nodes: self.quantized_nodes,
            kept_fp32: self.kept_fp32,
            rewrites: self.rewrites,
            weights: self.weights,
            gate: Some(self.gate),
            calibration_figures: self.calibration_figures,
            celer_version: env!("CARGO_PKG_VERSION").into(),
            built_at_unix_s: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
        };
        manifest.write(dir)?;
        Ok(manifest)
    }
}

/// `<engines>/<model>/<precision>/`.
pub fn variant_dir(engines_dir: &Path, model: &str, precision: ModelPrecision) -> PathBuf {
    engines_dir.join(model).join(precision.as_str())
}

/// What a device runs a model in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// ONNX Runtime on the CPU: the INT8 variant.
    Cpu,
    /// TensorRT on a GPU: the FP16 variant.
    Gpu,
}

impl Target {
    /// `cpu` or `gpu`, for logs and `celer inspect`.
    pub fn name(self) -> &'static str {
        match self {
            Target::Cpu => "cpu",
            Target::Gpu => "gpu",
        }
    }

    fn preferred(self) -> ModelPrecision {
        match self {
            Target::Cpu => ModelPrecision::Int8,
            Target::Gpu => ModelPrecision::Fp16,
        }
    }
}

/// The precision one model stage runs in on a device, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct StageChoice {
    /// `segmentation` or `matting`.
    pub stage: &'static str,
    pub precision: ModelPrecision,
    /// The variant's manifest when one is used.
    pub manifest: Option<VariantManifest>,
    /// Why FP32, when a variant was there but not used.
    pub reason: Option<String>,
}

impl StageChoice {
    /// One line for the log and `celer inspect`.
    pub fn describe(&self) -> String {
        match (&self.manifest, &self.reason) {
            (Some(m), _) => {
                let gate = m.gate.as_ref().map_or(String::new(), |g| {
                    format!(
                        ", gate IoU {:.4} and mean |Δα| {:.3}/255 on {} images",
                        g.overall.iou,
                        g.overall.mean_abs_diff,
                        g.images.len()
                    )
                });
                format!(
                    "{} {} ({}{gate})",
                    self.stage, self.precision, m.variant_file
                )
            }
            (None, Some(reason)) => format!("{} fp32 ({reason})", self.stage),
            (None, None) => format!("{} fp32", self.stage),
        }
    }
}

/// `spec` with each model stage swapped for its usable variant for `target` under
/// `engines_dir` (none when `force_fp32`), and the choice made for each stage.
pub fn choose(
    spec: &PipelineSpec,
    engines_dir: &Path,
    target: Target,
    force_fp32: bool,
) -> (PipelineSpec, Vec<StageChoice>) {
    let mut chosen = spec.clone();
    let mut choices = vec![choose_stage(
        "segmentation",
        &mut chosen.segmentation.image,
        engines_dir,
        target,
        force_fp32,
    )];
    if let MattingSpec::Model { image, .. } = &mut chosen.matting {
        choices.push(choose_stage(
            "matting",
            image,
            engines_dir,
            target,
            force_fp32,
        ));
    }
    (chosen, choices)
}

fn choose_stage(
    stage: &'static str,
    image: &mut ImageInputSpec,
    engines_dir: &Path,
    target: Target,
    force_fp32: bool,
) -> StageChoice {
    let fp32 = |reason: Option<String>| StageChoice {
        stage,
        precision: ModelPrecision::Fp32,
        manifest: None,
        reason,
    };
    let precision = target.preferred();
    let dir = variant_dir(engines_dir, &model_name(&image.model), precision);
    let manifest = match VariantManifest::read(&dir) {
        Ok(Some(m)) => m,
        Ok(None) => return fp32(None),
        Err(e) => return fp32(Some(e)),
    };
    if force_fp32 {
        return fp32(Some(format!(
            "{precision} variant not used: FP32 forced (--fp32)"
        )));
    }
    match usable(&manifest, precision, &image.model, &dir) {
        Ok(path) => {
            image.model = path;
            StageChoice {
                stage,
                precision,
                manifest: Some(manifest),
                reason: None,
            }
        }
        Err(reason) => fp32(Some(format!("{precision} variant not used: {reason}"))),
    }
}

/// The usable `precision` variant of `source` under `engines_dir`, if there is one: what
/// a build may keep instead of making it again.
pub fn current(
    engines_dir: &Path,
    source: &Path,
    precision: ModelPrecision,
) -> Option<VariantManifest> {
    let dir = variant_dir(engines_dir, &model_name(source), precision);
    let manifest = VariantManifest::read(&dir).ok()??;
    usable(&manifest, precision, source, &dir).ok()?;
    if precision == ModelPrecision::Int8 && manifest.rewrites.is_none() {
        return None;
    }
    Some(manifest)
}

/// The variant's file when `manifest` may be served in place of `source`.
fn usable(
    manifest: &VariantManifest,
    precision: ModelPrecision,
    source: &Path,
    dir: &Path,
) -> Result<PathBuf, String> {
    if manifest.format != VARIANT_FORMAT {
        return Err(format!(
            "its manifest is format {}, this celer reads {VARIANT_FORMAT}",
            manifest.format
        ));
    }
    if manifest.precision != precision {
        return Err(format!(
            "its manifest says {}, in the {precision} folder",
            manifest.precision
        ));
    }
    if precision == ModelPrecision::Int8 {
        weights_fit(manifest, Int8Products::of_this_cpu())?;
    }
    match &manifest.gate {
        None => return Err("its manifest records no gate figures".into()),
        Some(g) if !g.passed => return Err("it did not pass its gate".into()),
        Some(_) => {}
    }
    let source_sha = sha256_file(source).map_err(|e| format!("{}: {e}", source.display()))?;
    if !source_sha.eq_ignore_ascii_case(&manifest.source_sha256) {
        return Err(format!(
            "it was made from another {} (rebuild it with `celer build --precision {precision}`)",
            source.display()
        ));
    }
    let path = dir.join(&manifest.variant_file);
    let sha = sha256_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    if !sha.eq_ignore_ascii_case(&manifest.variant_sha256) {
        return Err(format!(
            "{} is not the file its manifest hashed",
            path.display()
        ));
    }
    Ok(path)
}

/// Whether the INT8 variant's weights compute on `cpu` what its gate measured.
fn weights_fit(manifest: &VariantManifest, cpu: Int8Products) -> Result<(), String> {
    let weights = manifest.weights.unwrap_or_default();
    if weights.runs_exactly_on(cpu) {
        return Ok(());
    }
    Err(format!(
        "its {weights} weights would saturate this CPU's int8 products (no VNNI); \
         `celer build --precision int8` here makes 7-bit ones"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn int8_manifest(weights: Option<WeightBits>) -> VariantManifest {
        VariantManifest {
            format: VARIANT_FORMAT,
            model: "m".into(),
            precision: ModelPrecision::Int8,
            source_file: "m.onnx".into(),
            source_sha256: String::new(),
            variant_file: "m.int8.onnx".into(),
            variant_sha256: String::new(),
            calibration: None,
            opset_from: 13,
            opset_to: 13,
            quantized_nodes: 1,
            kept_fp32: Vec::new(),
            rewrites: None,
            weights,
            gate: None,
            calibration_figures: None,
            celer_version: String::new(),
            built_at_unix_s: 0,
        }
    }

    #[test]
    fn an_int8_variant_with_8_bit_weights_is_not_served_where_products_saturate() {
        let eight = int8_manifest(Some(WeightBits::Eight));
        let before_the_field = int8_manifest(None);
        let seven = int8_manifest(Some(WeightBits::Seven));
        for m in [&eight, &before_the_field] {
            let refused = weights_fit(m, Int8Products::SaturatingPairs).expect_err("refused");
            assert!(
                refused.contains("8-bit weights would saturate"),
                "{refused}"
            );
            assert!(weights_fit(m, Int8Products::Wide).is_ok());
        }
        assert!(weights_fit(&seven, Int8Products::SaturatingPairs).is_ok());
        assert!(weights_fit(&seven, Int8Products::Wide).is_ok());
    }
}

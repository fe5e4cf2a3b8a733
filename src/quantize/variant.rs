//! Reduced-precision variants on disk, and which model the CPU serves. A variant is an
//! ONNX file with a manifest beside it, under `<model dir>/engines/<model>/<precision>/`:
//! what it was made from (the FP32 file's sha256), how (precision, calibration method
//! and images, the nodes kept in FP32) and what the gate measured. `serve` and `run`
//! use a variant only when its manifest says it passed its gate, its source is the
//! model file the pipeline names today, and its file is the one the manifest hashed;
//! anything else serves FP32, with the reason logged.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::gate::GateReport;
use super::ranges::Method;
use crate::engines::manifest::sha256_file;
use crate::spec::PipelineSpec;

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
    pub precision: String,
    /// The FP32 ONNX file, relative to the model directory, and its sha256.
    pub source_file: String,
    pub source_sha256: String,
    /// The variant's file, next to the manifest, and its sha256.
    pub variant_file: String,
    pub variant_sha256: String,
    pub calibration: Option<Calibration>,
    pub opset_from: u64,
    pub opset_to: u64,
    pub quantized_nodes: usize,
    pub kept_fp32: Vec<KeptNode>,
    /// The gate's figures on the validation images; absent, the variant is not served.
    pub gate: Option<GateReport>,
    /// The same figures on the calibration images, for the record (the search judged
    /// candidates on their overall figures).
    #[serde(default)]
    pub calibration_figures: Option<GateReport>,
    pub celer_version: String,
    pub built_at_unix_s: u64,
}

/// `<engines>/<model>/<precision>/`.
pub fn variant_dir(engines_dir: &Path, model: &str, precision: &str) -> PathBuf {
    engines_dir.join(model).join(precision)
}

/// The precision the CPU serves the segmentation model in, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct CpuChoice {
    pub precision: String,
    /// The variant's manifest when one is used.
    pub manifest: Option<VariantManifest>,
    /// Why FP32, when a variant was there but not used (or not looked for).
    pub reason: Option<String>,
}

impl CpuChoice {
    fn fp32(reason: Option<String>) -> Self {
        Self {
            precision: "fp32".into(),
            manifest: None,
            reason,
        }
    }
}

/// The stem naming a model's engine and variant folders.
fn model_name(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Reads the INT8 variant's manifest of `spec`'s segmentation model, if any.
pub fn read_manifest(dir: &Path) -> Result<Option<VariantManifest>, String> {
    let path = dir.join(VARIANT_MANIFEST);
    match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// The spec the CPU runs: `spec` with its segmentation model swapped for a usable INT8
/// variant under `engines_dir`, unless `force_fp32`.
pub fn for_cpu(
    spec: &PipelineSpec,
    engines_dir: &Path,
    force_fp32: bool,
) -> (PipelineSpec, CpuChoice) {
    let source = &spec.segmentation.image.model;
    let dir = variant_dir(engines_dir, &model_name(source), "int8");
    let manifest = match read_manifest(&dir) {
        Ok(Some(m)) => m,
        Ok(None) => return (spec.clone(), CpuChoice::fp32(None)),
        Err(e) => return (spec.clone(), CpuChoice::fp32(Some(e))),
    };
    if force_fp32 {
        return (
            spec.clone(),
            CpuChoice::fp32(Some("FP32 forced (--fp32)".into())),
        );
    }
    match usable(&manifest, source, &dir) {
        Ok(path) => {
            let mut cpu = spec.clone();
            cpu.segmentation.image.model = path;
            (
                cpu,
                CpuChoice {
                    precision: manifest.precision.clone(),
                    manifest: Some(manifest),
                    reason: None,
                },
            )
        }
        Err(reason) => (spec.clone(), CpuChoice::fp32(Some(reason))),
    }
}

/// The variant's file when `manifest` may be served in place of `source`.
fn usable(manifest: &VariantManifest, source: &Path, dir: &Path) -> Result<PathBuf, String> {
    if manifest.format != VARIANT_FORMAT {
        return Err(format!(
            "the variant manifest is format {}, this celer reads {VARIANT_FORMAT}",
            manifest.format
        ));
    }
    match &manifest.gate {
        None => return Err("the variant manifest records no gate figures".into()),
        Some(g) if !g.passed => return Err("the variant did not pass its gate".into()),
        Some(_) => {}
    }
    let source_sha = sha256_file(source).map_err(|e| format!("{}: {e}", source.display()))?;
    if source_sha != manifest.source_sha256 {
        return Err(format!(
            "the variant was made from another {} (sha256 {}); rebuild it with `celer build --precision int8`",
            source.display(),
            manifest.source_sha256
        ));
    }
    let path = dir.join(&manifest.variant_file);
    let sha = sha256_file(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    if sha != manifest.variant_sha256 {
        return Err(format!(
            "{} is not the file its manifest hashed",
            path.display()
        ));
    }
    Ok(path)
}

//! `celer build --precision int8` for the CPU: the segmentation model calibrated on the
//! user's images (`calibrate`) after its one-output-channel convolutions are split
//! (`one_channel`), rewritten to QDQ (`qdq`), searched for the convolutions to
//! keep in FP32 when the fully quantized model is below the gate (`search`), its
//! three-channel convolutions padded (`pad_channels`), judged on
//! held-out images (`gate`), and written with its manifest only if it passes.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Instant;

use sha2::{Digest, Sha256};

use super::calibrate::calibrate;
use super::gate::Gate;
use super::images::{load_dir, NamedImage};
use super::judge::{io_err, judge, Judge, Stage, WorkDir};
use super::model::OnnxModel;
use super::one_channel::split_one_channel_convs;
use super::opset::raise_for_qdq;
use super::pad_channels::pad_three_channel_convs;
use super::qdq::{name_nodes, rewrite};
use super::ranges::Method;
use super::search::search;
use super::variant::{variant_dir, Calibration, NewVariant, VariantManifest};
use super::weights::WeightBits;
use super::QuantizeError;
use crate::replica::cpu::model_input;
use crate::spec::{ModelPrecision, PipelineSpec};

/// What an INT8 build is asked for.
#[derive(Debug, Clone)]
pub struct Int8Options {
    pub calibration: PathBuf,
    pub validation: PathBuf,
    pub method: Method,
    pub gate: Gate,
    /// ONNX Runtime threads for calibration and the gate's runs.
    pub threads: usize,
    /// Search for convolutions to keep in FP32 when the fully quantized model fails.
    pub search: bool,
    /// At most this many calibration images rank the convolutions (each convolution is
    /// one run over them).
    pub sensitivity_images: usize,
}

/// A variant written.
#[derive(Debug, Clone)]
pub struct Int8Built {
    pub dir: PathBuf,
    pub manifest: VariantManifest,
}

/// A hash of an image's pixels: a validation image must not be a calibration image.
fn pixels_hash(im: &NamedImage) -> [u8; 32] {
    let mut h = Sha256::new();
    h.update(im.rgb.width().to_le_bytes());
    h.update(im.rgb.height().to_le_bytes());
    h.update(im.rgb.as_raw());
    h.finalize().into()
}

/// Tells `say` which nodes an exact rewrite changed, if any.
fn say_rewritten(say: &mut dyn FnMut(String), nodes: &[String], what: &str) {
    if !nodes.is_empty() {
        say(format!(
            "int8: {} {what}: {}",
            nodes.len(),
            nodes.join(", ")
        ));
    }
}

/// Calibrates `spec`'s segmentation model on `options.calibration`, rewrites it to QDQ
/// (searching for convolutions to keep in FP32 when needed), judges it on
/// `options.validation`, and writes it under `engines_dir` if it passes. `say` hears
/// progress, a line at a time.
pub fn build_int8(
    spec: &PipelineSpec,
    model_dir: &Path,
    engines_dir: &Path,
    options: &Int8Options,
    say: &mut dyn FnMut(String),
) -> Result<Int8Built, QuantizeError> {
    let started = Instant::now();
    let source = spec.segmentation.image.model.clone();
    let name = crate::engines::manifest::model_name(&source);
    let dir = variant_dir(engines_dir, &name, ModelPrecision::Int8);
    let work = WorkDir::create(dir.join(".work"))?;

    let calibration = load_dir(&options.calibration, "calibration")?;
    let validation = load_dir(&options.validation, "validation")?;
    let seen: HashMap<[u8; 32], &str> = calibration
        .iter()
        .map(|c| (pixels_hash(c), c.name.as_str()))
        .collect();
    for v in &validation {
        if let Some(c) = seen.get(&pixels_hash(v)) {
            return Err(QuantizeError::Unsupported(format!(
                "validation image {} is calibration image {c}: the gate needs held-out images",
                v.name
            )));
        }
    }
    say(format!(
        "int8: {} calibration images, {} validation images, {} ranges",
        calibration.len(),
        validation.len(),
        options.method
    ));

    let mut base = OnnxModel::load(&source)?;
    name_nodes(&mut base);
    let raised = raise_for_qdq(&mut base)?;
    if raised.from != raised.to {
        say(format!(
            "int8: operator set {} -> {} ({} nodes rewritten)",
            raised.from, raised.to, raised.rewritten
        ));
    }
    let split = split_one_channel_convs(&mut base)?;
    say_rewritten(
        say,
        &split,
        "one-output-channel convolutions split into depthwise + channel sum",
    );
    let image = &spec.segmentation.image;
    let inputs: Vec<Vec<f32>> = calibration
        .iter()
        .map(|im| model_input(&im.rgb, image))
        .collect();
    let calibrated = calibrate(
        spec,
        &base,
        &inputs,
        options.method,
        options.threads,
        &work.0,
    )?;
    say(format!(
        "int8: {} activations calibrated in {:.1} s; weights {} ({})",
        calibrated.ranges.len(),
        started.elapsed().as_secs_f64(),
        calibrated.weights,
        match calibrated.weights {
            WeightBits::Eight => "this CPU sums int8 products in 32 bits",
            WeightBits::Seven =>
                "this CPU has no VNNI: 8-bit weights would saturate its int16 pair sums",
        }
    ));

    let judge_with = Judge {
        spec,
        stage: Stage::Segmentation,
        threads: options.threads,
        work: &work.0,
    };
    let reference_cal = judge_with.reference(&calibration)?;
    let stable: Vec<bool> = (0..calibration.len())
        .map(|i| reference_cal.stable(&options.gate, i))
        .collect();
    let unstable: Vec<&str> = calibration
        .iter()
        .zip(&stable)
        .filter(|(_, &s)| !s)
        .map(|(im, _)| im.name.as_str())
        .collect();
    if !unstable.is_empty() {
        say(format!(
            "int8: FP32 itself moves beyond the gate under a one-level change of {}: judged overall only",
            unstable.join(", ")
        ));
    }
    let (full, full_rewrite) = rewrite(
        &base,
        &calibrated.ranges,
        &HashSet::new(),
        calibrated.weights,
    )?;
    let full_report = judge(
        &options.gate,
        &calibration,
        &reference_cal,
        &judge_with.alphas(&full, &calibration)?,
    );
    say(format!(
        "int8: all {} convolutions quantized: calibration images IoU {:.4}, mean |Δα| {:.3}/255",
        full_rewrite.quantized.len(),
        full_report.overall.iou,
        full_report.overall.mean_abs_diff
    ));

    let (mut chosen, chosen_rewrite, kept, calibration_report) =
        if options.gate.passes(&full_report.overall) || !options.search {
            (full, full_rewrite, Vec::new(), full_report)
        } else {
            // The ranking's images: those FP32 is stable on (all, if it is on none).
            let on_stable: Vec<Vec<f32>> = inputs
                .iter()
                .zip(&stable)
                .filter(|(_, &s)| s)
                .map(|(x, _)| x.clone())
                .collect();
            let pool = if on_stable.is_empty() {
                &inputs
            } else {
                &on_stable
            };
            let sample = &pool[..pool.len().min(options.sensitivity_images.max(1))];
            let chosen = search(
                &judge_with,
                &base,
                &calibrated,
                &options.gate,
                &calibration,
                sample,
                &reference_cal,
                say,
            )?;
            (
                chosen.model,
                chosen.rewrite,
                chosen.kept,
                chosen.calibration_report,
            )
        };

    say(format!(
        "int8: {} convolutions int8, {} kept in FP32; on the calibration images (for the \
         record: the search holds their overall row to the gate, {}; the per-image limits \
         are the verdict's, on the validation images):\n{}",
        chosen_rewrite.quantized.len(),
        kept.len(),
        if options.gate.passes(&calibration_report.overall) {
            "within it"
        } else {
            "not within it"
        },
        calibration_report.table()
    ));
    if chosen_rewrite.quantized.is_empty() {
        return Err(QuantizeError::Unsupported(
            "no convolution can be quantized within the gate on the calibration images".into(),
        ));
    }

    // Exact, so after the search: it judged the same arithmetic.
    let padded = pad_three_channel_convs(&mut chosen)?;
    say_rewritten(
        say,
        &padded,
        "three-channel convolutions padded to four channels",
    );
    let rewrites: Vec<String> = split
        .iter()
        .map(|n| format!("{n}: one output channel, split into depthwise + channel sum"))
        .chain(
            padded
                .iter()
                .map(|n| format!("{n}: three input channels, padded to four")),
        )
        .collect();

    // The verdict, on images the build has not looked at.
    let report = judge_with.verdict(&options.gate, &validation, &chosen)?;
    say(format!(
        "int8: gate on the validation images\n{}",
        report.table()
    ));

    let manifest = NewVariant {
        model: &chosen,
        precision: ModelPrecision::Int8,
        source: &source,
        model_dir,
        calibration: Some(Calibration {
            method: options.method,
            images: calibration.iter().map(|c| c.name.clone()).collect(),
        }),
        opset: (raised.from, raised.to),
        quantized_nodes: chosen_rewrite.quantized.len(),
        kept_fp32: kept,
        rewrites: Some(rewrites),
        weights: Some(calibrated.weights),
        gate: report,
        calibration_figures: Some(calibration_report),
    }
    .write(&dir)
    .map_err(io_err(&dir))?;
    let variant_path = dir.join(&manifest.variant_file);
    say(format!(
        "int8: {} written ({} convolutions int8, {} kept in FP32) in {:.0} s",
        variant_path.display(),
        manifest.quantized_nodes,
        manifest.kept_fp32.len(),
        started.elapsed().as_secs_f64()
    ));
    Ok(Int8Built { dir, manifest })
}

//! Mixed precision by measured sensitivity: which convolutions to keep in FP32 when the
//! fully quantized model is below the gate.
//!
//! Each convolution is quantized alone (every other one in FP32) and the mean |difference|
//! of the model's output from FP32's on a few calibration images is its sensitivity: its
//! own share of the damage. (Leaving one out of a fully quantized model would measure
//! little on a model like U2NetP, whose error is many small ones compounding.) What
//! keeping it costs is estimated from calibration's tensor sizes: its multiply-adds, and
//! the values that cross between 8 bits and float around it (each a dequantize, a
//! layout change and a quantize, which cost about as much as `BOUNDARY_MACS`
//! multiply-adds on ONNX Runtime's CPU kernels). Convolutions are kept in order of
//! sensitivity per cost, as few as the gate allows: a bisection over that order for the
//! shortest prefix whose pipeline alpha passes the gate on the calibration images (the
//! validation images stay held out for the final verdict). So the search maximizes the
//! work that runs in 8 bits, not the count of quantized nodes.
//!
//! A candidate passes the search when the gate's overall figures (all pixels of the
//! calibration images together) are within its limits; the per-image limits are the
//! verdict's, on the held-out images. Per image, a calibration set with a cluttered scene
//! would keep most of a model in FP32 (U2NetP on the motorcycle photo stays at IoU
//! 0.974-0.980 whichever few convolutions are kept, while every validation photo is at
//! 0.99 or more), and judging per image on the validation images during the search
//! would make them chosen on, not held out.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use super::calibrate::Calibrated;
use super::gate::{Gate, GateReport};
use super::images::NamedImage;
use super::judge::{judge, mean_abs_diff, Judge, Reference};
use super::model::OnnxModel;
use super::qdq::{quantizable_convs, rewrite, Rewrite};
use super::variant::KeptNode;
use super::QuantizeError;

/// What one value crossing between 8 bits and float costs, in multiply-adds (measured
/// on U2NetP with ONNX Runtime 1.31 on an AVX-512 VNNI core: its two most sensitive
/// convolutions kept in FP32 cost about 8 ms a run on one thread, 3 ms of it their
/// arithmetic).
const BOUNDARY_MACS: f64 = 300.0;

/// A convolution, its own share of the damage, and what keeping it in FP32 costs.
#[derive(Debug, Clone, PartialEq)]
pub struct Sensitivity {
    pub node: String,
    /// Mean |output difference| from FP32 with this convolution alone quantized.
    pub error: f64,
    /// Its multiply-adds plus `BOUNDARY_MACS` per value around it, in one run.
    pub cost: f64,
}

/// The cost of keeping each convolution of `model` in FP32, from calibration's sizes.
pub fn costs(model: &OnnxModel, calibrated: &Calibrated) -> HashMap<String, f64> {
    let inits = model.initializer_index();
    let size = |t: &str| calibrated.elements.get(t).copied().unwrap_or(0) as f64;
    model
        .nodes
        .iter()
        .filter(|n| n.op_type() == "Conv")
        .filter_map(|n| {
            let ins = n.inputs();
            let out = n.outputs().first()?.clone();
            let w = &model.initializers[*inits.get(ins.get(1)?)?];
            let per_output: i64 = w.dims().ok()?.iter().skip(1).product();
            let macs = size(&out) * per_output as f64;
            let boundary = size(ins.first()?) + size(&out);
            Some((n.name(), macs + BOUNDARY_MACS * boundary))
        })
        .collect()
}

/// Each convolution of `candidates` quantized alone, in the order to keep them: the most
/// sensitive per cost first.
pub fn rank(
    judge_with: &Judge<'_>,
    base: &OnnxModel,
    calibrated: &Calibrated,
    candidates: &[String],
    sample: &[Vec<f32>],
) -> Result<Vec<Sensitivity>, QuantizeError> {
    let reference = judge_with.outputs(base, sample)?;
    let costs = costs(base, calibrated);
    let all: HashSet<String> = candidates.iter().cloned().collect();
    let mut ranked = Vec::with_capacity(candidates.len());
    for node in candidates {
        let mut keep = all.clone();
        keep.remove(node);
        let (m, _) = rewrite(base, &calibrated.ranges, &keep, calibrated.weights)?;
        let error = mean_abs_diff(&reference, &judge_with.outputs(&m, sample)?);
        ranked.push(Sensitivity {
            node: node.clone(),
            error,
            cost: costs.get(node).copied().unwrap_or(1.0).max(1.0),
        });
    }
    ranked.sort_by(|a, b| (b.error / b.cost).total_cmp(&(a.error / a.cost)));
    Ok(ranked)
}

/// What the search chose.
pub struct Chosen {
    pub model: OnnxModel,
    pub rewrite: Rewrite,
    /// The convolutions kept in FP32, in the order they were kept.
    pub kept: Vec<KeptNode>,
    /// The chosen model on the calibration images.
    pub calibration_report: GateReport,
}

/// The fewest of `base`'s convolutions kept in FP32, in ranking order, whose alpha on
/// the calibration images is within `gate` overall. `say` hears progress.
#[allow(clippy::too_many_arguments)]
pub fn search(
    judge_with: &Judge<'_>,
    base: &OnnxModel,
    calibrated: &Calibrated,
    gate: &Gate,
    calibration: &[NamedImage],
    sample: &[Vec<f32>],
    reference: &Reference,
    say: &mut dyn FnMut(String),
) -> Result<Chosen, QuantizeError> {
    let started = Instant::now();
    let candidates = quantizable_convs(base)?;
    let ranked = rank(judge_with, base, calibrated, &candidates, sample)?;
    let total_cost: f64 = ranked.iter().map(|s| s.cost).sum();
    say(format!(
        "int8: {} convolutions ranked on {} images in {:.0} s; first to keep: {}",
        ranked.len(),
        sample.len(),
        started.elapsed().as_secs_f64(),
        ranked
            .iter()
            .take(5)
            .map(|s| format!(
                "{} ({:.4}, {:.1} % of the cost)",
                s.node,
                s.error,
                100.0 * s.cost / total_cost
            ))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let candidate = |kept: usize| -> Result<(OnnxModel, Rewrite, GateReport), QuantizeError> {
        let keep: HashSet<String> = ranked[..kept].iter().map(|s| s.node.clone()).collect();
        let (m, r) = rewrite(base, &calibrated.ranges, &keep, calibrated.weights)?;
        let report = judge(
            gate,
            calibration,
            reference,
            &judge_with.alphas(&m, calibration)?,
        );
        Ok((m, r, report))
    };
    // Keeping every convolution is FP32 itself, which passes: bisect for the fewest kept.
    let (mut fails, mut passes) = (0usize, ranked.len());
    let mut best = None;
    while passes - fails > 1 {
        let mid = (fails + passes) / 2;
        let (m, r, report) = candidate(mid)?;
        let kept_cost: f64 = ranked[..mid].iter().map(|s| s.cost).sum();
        let passed = gate.passes(&report.overall);
        say(format!(
            "int8: keeping {mid} in FP32 ({:.1} % of the cost): calibration IoU {:.4}, mean |Δα| {:.3}/255 ({})",
            100.0 * kept_cost / total_cost,
            report.overall.iou,
            report.overall.mean_abs_diff,
            if passed { "passes" } else { "fails" }
        ));
        if passed {
            passes = mid;
            best = Some((m, r, report));
        } else {
            fails = mid;
        }
    }
    let (model, rewrite, calibration_report) = match best {
        Some(b) => b,
        None => candidate(passes)?,
    };
    let kept = ranked[..passes]
        .iter()
        .map(|s| KeptNode {
            node: s.node.clone(),
            sensitivity: s.error,
            cost_share: s.cost / total_cost,
        })
        .collect();
    Ok(Chosen {
        model,
        rewrite,
        kept,
        calibration_report,
    })
}

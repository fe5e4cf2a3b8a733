//! Mixed precision by measured sensitivity: which convolutions to keep in FP32 when the
//! fully quantized model is below the gate.
//!
//! Each convolution is quantized alone (every other one in FP32) and the mean |difference|
//! of the model's output from FP32's on a few calibration images is its sensitivity: its
//! own share of the damage. Leaving one out of a fully quantized model would measure
//! little on a model like U2NetP, whose error is many small ones compounding. Then the
//! least sensitive are quantized, as many as the gate allows: a bisection over the ranking
//! for the longest prefix whose pipeline alpha passes the gate on the calibration images
//! (the validation images stay held out for the final verdict), with a stricter gate
//! there (`search_gate`) so that what passes on the images the search has seen keeps a
//! margin on those it has not.

use std::collections::{HashMap, HashSet};
use std::time::Instant;

use image::GrayImage;

use super::gate::{Gate, GateReport};
use super::images::NamedImage;
use super::judge::{judge, mean_abs_diff, Judge};
use super::model::OnnxModel;
use super::qdq::{rewrite, Rewrite};
use super::ranges::Range;
use super::variant::KeptNode;
use super::QuantizeError;

/// The gate the search holds candidates to on the calibration images: half the loss the
/// final gate allows, so that a pass there is likely to pass on held-out images.
pub fn search_gate(gate: &Gate) -> Gate {
    Gate {
        min_iou: 1.0 - (1.0 - gate.min_iou) / 2.0,
        max_mean_abs_diff: gate.max_mean_abs_diff / 2.0,
    }
}

/// A convolution and its own share of the damage.
#[derive(Debug, Clone, PartialEq)]
pub struct Sensitivity {
    pub node: String,
    /// Mean |output difference| from FP32 with this convolution alone quantized.
    pub error: f64,
}

/// Each convolution of `candidates` quantized alone, most sensitive first.
pub fn rank(
    judge_with: &Judge<'_>,
    base: &OnnxModel,
    ranges: &HashMap<String, Range>,
    candidates: &[String],
    sample: &[Vec<f32>],
) -> Result<Vec<Sensitivity>, QuantizeError> {
    let reference = judge_with.outputs(base, sample)?;
    let all: HashSet<String> = candidates.iter().cloned().collect();
    let mut ranked = Vec::with_capacity(candidates.len());
    for node in candidates {
        let mut keep = all.clone();
        keep.remove(node);
        let (m, _) = rewrite(base, ranges, &keep)?;
        let error = mean_abs_diff(&reference, &judge_with.outputs(&m, sample)?);
        ranked.push(Sensitivity {
            node: node.clone(),
            error,
        });
    }
    ranked.sort_by(|a, b| b.error.total_cmp(&a.error));
    Ok(ranked)
}

/// What the search chose.
pub struct Chosen {
    pub model: OnnxModel,
    pub rewrite: Rewrite,
    /// The convolutions kept in FP32, most sensitive first.
    pub kept: Vec<KeptNode>,
    /// The chosen model on the calibration images, against `search_gate`.
    pub calibration_report: GateReport,
}

/// The most convolutions quantized, least sensitive first, whose alpha passes
/// `search_gate(gate)` on the calibration images. `say` hears progress.
#[allow(clippy::too_many_arguments)]
pub fn search(
    judge_with: &Judge<'_>,
    base: &OnnxModel,
    ranges: &HashMap<String, Range>,
    candidates: &[String],
    gate: &Gate,
    calibration: &[NamedImage],
    sample: &[Vec<f32>],
    reference: &[GrayImage],
    say: &mut dyn FnMut(String),
) -> Result<Chosen, QuantizeError> {
    let started = Instant::now();
    let ranked = rank(judge_with, base, ranges, candidates, sample)?;
    say(format!(
        "int8: {} convolutions ranked on {} images in {:.0} s; most sensitive: {}",
        ranked.len(),
        sample.len(),
        started.elapsed().as_secs_f64(),
        ranked
            .iter()
            .take(5)
            .map(|s| format!("{} ({:.4})", s.node, s.error))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    let strict = search_gate(gate);
    let candidate = |kept: usize| -> Result<(OnnxModel, Rewrite, GateReport), QuantizeError> {
        let keep: HashSet<String> = ranked[..kept].iter().map(|s| s.node.clone()).collect();
        let (m, r) = rewrite(base, ranges, &keep)?;
        let report = judge(
            &strict,
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
        say(format!(
            "int8: keeping {mid} in FP32: calibration IoU {:.4}, mean |Δα| {:.3}/255 ({})",
            report.overall.iou,
            report.overall.mean_abs_diff,
            if report.passed { "passes" } else { "fails" }
        ));
        if report.passed {
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
        })
        .collect();
    Ok(Chosen {
        model,
        rewrite,
        kept,
        calibration_report,
    })
}

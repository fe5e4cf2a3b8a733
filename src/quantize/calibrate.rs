//! Calibration: the ranges of the activations an INT8 rewrite quantizes, measured by
//! running the FP32 model with ONNX Runtime on the calibration images, every measured
//! activation made a graph output so that one run per image reads them all. Methods that
//! need a histogram take a second pass, its bins fixed by the first pass's extremes.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use super::judge::{input_shape, io_err};
use super::model::OnnxModel;
use super::qdq::measured_tensors;
use super::ranges::{Histogram, Method, Range};
use super::weights::WeightBits;
use super::QuantizeError;
use crate::ort::session::{OpThreads, OrtModel};
use crate::spec::PipelineSpec;

/// What calibration measured.
#[derive(Debug, Clone, Default)]
pub struct Calibrated {
    /// Each measured activation's range, as the method picks it.
    pub ranges: HashMap<String, Range>,
    /// Each measured activation's number of values in one run (the search's cost model).
    pub elements: HashMap<String, usize>,
    /// The weights' width on the CPU that calibrates, gates and (the manifest says so)
    /// serves the variant (`quantize::weights`).
    pub weights: WeightBits,
}

/// Each measured activation of `base`, its size and the range `method` picks for it over
/// `inputs` (the segmentation model's prepared inputs of the calibration images).
pub fn calibrate(
    spec: &PipelineSpec,
    base: &OnnxModel,
    inputs: &[Vec<f32>],
    method: Method,
    threads: usize,
    work: &Path,
) -> Result<Calibrated, QuantizeError> {
    let tensors = measured_tensors(base)?;
    let mut augmented = base.clone();
    let outputs: HashSet<String> = augmented.output_names().into_iter().collect();
    for t in &tensors {
        if !outputs.contains(t) {
            augmented.add_float_output(t);
        }
    }
    let path = work.join("calibration.onnx");
    augmented.save(&path).map_err(io_err(&path))?;
    let mut session = OrtModel::load_uncached(
        &path,
        OpThreads::Own {
            threads,
            alone: true,
        },
    )?;
    let input = spec.segmentation.image.input.as_str();
    let shape = input_shape(spec);
    let names: Vec<&str> = tensors.iter().map(String::as_str).collect();
    let mut seen = vec![Range::EMPTY; tensors.len()];
    let mut elements = HashMap::new();
    for x in inputs {
        let values = session.run_outputs(&[(input, shape, x)], &names)?;
        for ((r, v), t) in seen.iter_mut().zip(&values).zip(&tensors) {
            r.observe(&v.data);
            elements.insert(t.clone(), v.data.len());
        }
    }
    if !method.needs_histogram() {
        return Ok(Calibrated {
            ranges: tensors.into_iter().zip(seen).collect(),
            elements,
            weights: WeightBits::for_this_cpu(),
        });
    }
    let mut histograms: Vec<Histogram> = seen.iter().map(|r| Histogram::new(*r)).collect();
    for x in inputs {
        let values = session.run_outputs(&[(input, shape, x)], &names)?;
        for (h, v) in histograms.iter_mut().zip(&values) {
            h.observe(&v.data);
        }
    }
    Ok(Calibrated {
        ranges: tensors
            .into_iter()
            .zip(histograms.iter().zip(&seen))
            .map(|(t, (h, r))| (t, h.range(method, *r)))
            .collect(),
        elements,
        weights: WeightBits::for_this_cpu(),
    })
}

//! The FP16 conversion: a float32 model rewritten to compute in float16, its graph inputs
//! and outputs kept float32 (a Cast after each input and before each output), so that the
//! stages around the model (the CUDA kernels, the CPU stages) are unchanged. TensorRT 11
//! builds strongly typed networks: this file is how a GPU gets FP16 layers there.
//!
//! What stays float32: the inputs that ONNX defines as float32 whatever the data's type
//! (Resize's `roi` and `scales`, Upsample's `scales`), and every tensor that only feeds
//! them (a Constant, a Cast to float, an initializer).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

use super::gate::Gate;
use super::images::load_dir;
use super::judge::{io_err, Judge, Stage, WorkDir};
use super::model::{DataType, ModelError, Node, OnnxModel};
use super::variant::{variant_dir, NewVariant, VariantManifest};
use super::QuantizeError;
use crate::spec::{ModelPrecision, PipelineSpec};

/// The inputs, by operator, that must stay float32.
fn float32_slot(op: &str, slot: usize) -> bool {
    matches!((op, slot), ("Resize", 1 | 2) | ("Upsample", 1))
}

/// What the conversion did, for the build's report.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Converted {
    pub initializers: usize,
    pub constants: usize,
    pub casts: usize,
    /// Tensors left float32 because an operator needs them so.
    pub kept_float32: usize,
}

/// The tensors that only feed float32 slots, directly or through Casts and Constants
/// that feed nothing else.
fn float32_only(model: &OnnxModel) -> HashSet<String> {
    let consumers = model.consumers();
    let graph_outputs: HashSet<String> = model.output_names().into_iter().collect();
    let mut keep: HashSet<String> = HashSet::new();
    // Walk back from the float32 slots: a tensor is kept when every reader is a kept slot
    // or a Cast whose output is kept. Graphs are small; iterate to a fixpoint.
    loop {
        let mut grew = false;
        let mut candidates: Vec<String> = Vec::new();
        for node in &model.nodes {
            for (slot, input) in node.inputs().iter().enumerate() {
                if !input.is_empty() && float32_slot(&node.op_type(), slot) {
                    candidates.push(input.clone());
                }
            }
            if node.op_type() == "Cast" && node.outputs().iter().all(|o| keep.contains(o)) {
                candidates.extend(node.inputs());
            }
        }
        for t in candidates {
            if keep.contains(&t) || graph_outputs.contains(&t) {
                continue;
            }
            let all_kept = consumers.get(&t).is_none_or(|readers| {
                readers.iter().all(|&r| {
                    let reader = &model.nodes[r];
                    let op = reader.op_type();
                    reader
                        .inputs()
                        .iter()
                        .enumerate()
                        .filter(|(_, i)| **i == t)
                        .all(|(slot, _)| float32_slot(&op, slot))
                        || (op == "Cast" && reader.outputs().iter().all(|o| keep.contains(o)))
                })
            });
            if all_kept {
                keep.insert(t);
                grew = true;
            }
        }
        if !grew {
            return keep;
        }
    }
}

/// `model` computing in float16, its interface float32.
pub fn convert(model: &OnnxModel) -> Result<(OnnxModel, Converted), ModelError> {
    let mut m = model.clone();
    let keep = float32_only(&m);
    let mut report = Converted {
        kept_float32: keep.len(),
        ..Converted::default()
    };
    for init in &mut m.initializers {
        if keep.contains(&init.name()) {
            continue;
        }
        if let Some(half) = init.to_f16()? {
            *init = half;
            report.initializers += 1;
        }
    }
    for node in &mut m.nodes {
        let writes_kept = node.outputs().iter().any(|o| keep.contains(o));
        match node.op_type().as_str() {
            "Constant" if !writes_kept => {
                if let Some(half) = node
                    .tensor_attribute("value")?
                    .and_then(|t| t.to_f16().ok().flatten())
                {
                    node.set_tensor_attribute("value", &half)?;
                    report.constants += 1;
                }
            }
            "Cast" if !writes_kept && node.int_attribute("to")? == Some(DataType::Float as i64) => {
                node.set_int_attribute("to", DataType::Float16 as i64)?;
                report.casts += 1;
            }
            _ => {}
        }
    }

    // The interface: float32 inputs cast down on entry, float32 outputs cast up on exit.
    let mut names = m.names();
    let mut fresh = |stem: String| names.fresh(&stem);
    let mut entry = Vec::new();
    let mut renamed_inputs: HashMap<String, String> = HashMap::new();
    for x in m.float_input_names()? {
        let half = fresh(format!("{x}_fp16"));
        entry.push(
            Node::new("Cast", &fresh(format!("{x}_to_fp16")), &[&x], &[&half])
                .with_int("to", DataType::Float16 as i64),
        );
        renamed_inputs.insert(x, half);
    }
    let mut exit = Vec::new();
    let mut renamed_outputs: HashMap<String, String> = HashMap::new();
    for (y, ty) in m.output_names().into_iter().zip(m.output_elem_types()?) {
        if ty != DataType::Float as u64 {
            continue;
        }
        let half = fresh(format!("{y}_fp16"));
        exit.push(
            Node::new("Cast", &fresh(format!("{y}_to_fp32")), &[&half], &[&y])
                .with_int("to", DataType::Float as i64),
        );
        renamed_outputs.insert(y, half);
    }
    for node in &mut m.nodes {
        for (slot, input) in node.inputs().iter().enumerate() {
            let renamed = renamed_inputs
                .get(input)
                .or_else(|| renamed_outputs.get(input));
            if let Some(r) = renamed {
                node.set_input(slot, r);
            }
        }
        for (slot, output) in node.outputs().iter().enumerate() {
            if let Some(r) = renamed_outputs.get(output) {
                node.set_output(slot, r);
            }
        }
    }
    entry.append(&mut m.nodes);
    entry.extend(exit);
    m.nodes = entry;
    m.clear_value_info();
    Ok((m, report))
}

/// What an FP16 build is asked for.
#[derive(Debug, Clone)]
pub struct Fp16Options {
    pub validation: PathBuf,
    pub gate: Gate,
    /// ONNX Runtime threads for the gate's runs.
    pub threads: usize,
}

/// `stage`'s model of `spec` converted to FP16, judged by `gate` on the images of
/// `validation` with ONNX Runtime on the CPU (which runs what it has no FP16 kernel for in
/// float32: the gate sees the weights' and activations' rounding, not a GPU's arithmetic),
/// and written under `engines_dir` if it passes. Returns its folder and manifest.
pub fn build_fp16(
    spec: &PipelineSpec,
    stage: Stage,
    model_dir: &Path,
    engines_dir: &Path,
    options: &Fp16Options,
    say: &mut dyn FnMut(String),
) -> Result<(PathBuf, VariantManifest), QuantizeError> {
    let Fp16Options {
        validation,
        gate,
        threads,
    } = options;
    let source = stage
        .image(spec)
        .ok_or_else(|| {
            QuantizeError::Unsupported(format!("the pipeline runs no {} model", stage.name()))
        })?
        .model
        .clone();
    let name = crate::engines::manifest::model_name(&source);
    let dir = variant_dir(engines_dir, &name, ModelPrecision::Fp16);
    let work = WorkDir::create(dir.join(".work"))?;
    let images = load_dir(validation, "validation")?;
    let base = OnnxModel::load(&source)?;
    let opset = base.opset()?;
    let (half, report) = convert(&base)?;
    say(format!(
        "fp16: {} model: {} initializers, {} constants and {} casts to float16, {} tensors kept float32",
        stage.name(),
        report.initializers,
        report.constants,
        report.casts,
        report.kept_float32
    ));
    let judge_with = Judge {
        spec,
        stage,
        threads: *threads,
        work: &work.0,
    };
    let verdict = judge_with.verdict(gate, &images, &half)?;
    say(format!(
        "fp16: gate on the validation images\n{}",
        verdict.table()
    ));
    let manifest = NewVariant {
        model: &half,
        precision: ModelPrecision::Fp16,
        source: &source,
        model_dir,
        calibration: None,
        opset: (opset, opset),
        quantized_nodes: 0,
        kept_fp32: Vec::new(),
        rewrites: None,
        weights: None,
        gate: verdict,
        calibration_figures: None,
    }
    .write(&dir)
    .map_err(io_err(&dir))?;
    Ok((dir, manifest))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> OnnxModel {
        OnnxModel::load(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("onnx/fixtures")
                .join(name),
        )
        .expect("fixture")
    }

    #[test]
    fn weights_become_float16_and_the_interface_stays_float32() {
        let m = fixture("prob.onnx");
        let (h, report) = convert(&m).expect("convert");
        assert_eq!(report.initializers, m.initializers.len());
        assert!(h
            .initializers
            .iter()
            .all(|i| i.data_type() == DataType::Float16 as u64));
        let ops: Vec<String> = h.nodes.iter().map(Node::op_type).collect();
        assert_eq!(ops, vec!["Cast", "Conv", "Sigmoid", "Cast"]);
        assert_eq!(h.output_names(), m.output_names());
        assert_eq!(
            h.float_input_names().expect("inputs"),
            m.float_input_names().expect("inputs")
        );
        let first = &h.nodes[0];
        assert_eq!(first.inputs(), vec!["image"]);
        assert_eq!(
            first.int_attribute("to").expect("to"),
            Some(DataType::Float16 as i64)
        );
        let last = h.nodes.last().expect("node");
        assert_eq!(last.outputs(), vec!["mask"]);
        assert_eq!(
            last.int_attribute("to").expect("to"),
            Some(DataType::Float as i64)
        );
    }

    #[test]
    fn resize_scales_stay_float32() {
        let mut m = fixture("prob.onnx");
        // mask -> Resize(mask, roi, scales) -> up, the scales a float Constant.
        let out = m.output_names()[0].clone();
        let mut scales = Node::new("Constant", "scales_const", &[], &["scales"]);
        let t = super::super::model::Initializer::f32("", &[4], &[1.0, 1.0, 2.0, 2.0]);
        let mut attr = super::super::proto::Message::default();
        attr.push_string(1, "value")
            .push_message(5, &t.0)
            .push_varint(20, 4);
        scales.0.push_message(5, &attr);
        let resize = Node::new("Resize", "up", &[&out, "", "scales"], &["up"]);
        m.nodes.push(scales);
        m.nodes.push(resize);
        m.outputs[0].set_string(1, "up");
        let (h, report) = convert(&m).expect("convert");
        assert_eq!(report.kept_float32, 1);
        let c = h
            .nodes
            .iter()
            .find(|n| n.name() == "scales_const")
            .expect("constant");
        let value = c.tensor_attribute("value").expect("attr").expect("tensor");
        assert_eq!(value.data_type(), DataType::Float as u64);
        assert_eq!(report.constants, 0);
    }
}

//! The INT8 rewrite, in ONNX's QDQ form: every activation a quantized convolution reads
//! or writes passes through QuantizeLinear -> DequantizeLinear (uint8, the range from
//! calibration), and each quantized convolution's weights are int8 per output channel
//! (symmetric) with an int32 bias, each behind a DequantizeLinear. The model stays a
//! float model any runtime can run; ONNX Runtime (and TensorRT) fuse each
//! DQ -> Conv -> Q into one 8-bit convolution. What the rewrite decides, and why:
//! - a ReLU right after a quantized convolution is dropped: its output's range starts at
//!   0, so the uint8 Q clamps exactly as ReLU does, and ONNX Runtime would drop it too;
//! - MaxPool and Resize pass a quantized input's parameters to their output, so that
//!   ONNX Runtime runs them on the 8-bit values (its rule needs equal parameters);
//! - Concat and Add whose inputs are all quantized get a quantized output when a
//!   quantized node reads it (ONNX Runtime then runs the 8-bit QLinearConcat/QLinearAdd);
//! - a convolution named in `keep_fp32` keeps its float weights and reads the float
//!   tensor: the mixed-precision search's handle.

use std::collections::{HashMap, HashSet};

use super::model::{Initializer, ModelError, Names, Node, OnnxModel};
use super::ranges::{Range, U8Params};
use super::weights::WeightBits;

/// Operators that pass an 8-bit input through with its parameters.
const PASS_THROUGH: &[&str] = &["MaxPool", "Resize"];
/// Operators ONNX Runtime runs in 8 bits when every input and the output are quantized.
const ELEMENTWISE: &[&str] = &["Concat", "Add"];

/// Gives every unnamed node the name `<op>_<index>`, so that nodes can be named in a
/// report, in a manifest and from one build to the next.
pub fn name_nodes(model: &mut OnnxModel) {
    let mut names = Names(model.nodes.iter().map(Node::name).collect());
    for (i, node) in model.nodes.iter_mut().enumerate() {
        if node.name().is_empty() {
            let name = names.fresh(&format!("{}_{i}", node.op_type()));
            node.0.set_string(3, &name);
        }
    }
}

/// The convolutions the rewrite can quantize: float weights from an initializer (and a
/// float bias, if any), by node name in graph order.
pub fn quantizable_convs(model: &OnnxModel) -> Result<Vec<String>, ModelError> {
    let inits = model.initializer_index();
    let mut out = Vec::new();
    for node in &model.nodes {
        if node.op_type() != "Conv" || !node.is_onnx() {
            continue;
        }
        let inputs = node.inputs();
        let float_init = |name: Option<&String>| -> Result<bool, ModelError> {
            Ok(match name.and_then(|n| inits.get(n)) {
                Some(&i) => model.initializers[i].floats()?.is_some(),
                None => false,
            })
        };
        let bias_ok = inputs.get(2).is_none_or(|b| b.is_empty()) || float_init(inputs.get(2))?;
        if float_init(inputs.get(1))? && bias_ok {
            out.push(node.name());
        }
    }
    Ok(out)
}

/// The float activations calibration measures: every output of a Conv, ReLU, MaxPool,
/// Resize, and of a Concat or Add of such tensors, and the graph inputs convolutions read.
pub fn measured_tensors(model: &OnnxModel) -> Result<Vec<String>, ModelError> {
    let inits: HashSet<String> = model.initializers.iter().map(Initializer::name).collect();
    let inputs: HashSet<String> = model.input_names()?.into_iter().collect();
    let mut float: HashSet<String> = HashSet::new();
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    for node in &model.nodes {
        if !node.is_onnx() {
            continue;
        }
        let op = node.op_type();
        let ins = node.inputs();
        if op == "Conv" {
            if let Some(x) = ins.first() {
                if inputs.contains(x) && !inits.contains(x) && seen.insert(x.clone()) {
                    float.insert(x.clone());
                    out.push(x.clone());
                }
            }
        }
        let produces_float = match op.as_str() {
            "Conv" | "Relu" => true,
            "MaxPool" | "Resize" => ins.first().is_some_and(|x| float.contains(x)),
            "Concat" | "Add" => !ins.is_empty() && ins.iter().all(|x| float.contains(x)),
            _ => false,
        };
        if produces_float {
            if let Some(y) = node.outputs().first() {
                float.insert(y.clone());
                if seen.insert(y.clone()) {
                    out.push(y.clone());
                }
            }
        }
    }
    Ok(out)
}

/// What the rewrite did.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rewrite {
    /// Convolutions now 8-bit, by name.
    pub quantized: Vec<String>,
    /// Convolutions kept in float (asked for, or not quantizable).
    pub kept: Vec<String>,
    /// Activations given a Q -> DQ pair.
    pub activations: usize,
    /// ReLUs dropped into the Q after their convolution.
    pub relus_dropped: usize,
}

/// The QDQ model of `model` (at operator set 13 or above, nodes named) with `ranges` for
/// its measured tensors, the convolutions in `keep_fp32` left in float, the others'
/// weights on `weights`' levels.
pub fn rewrite(
    model: &OnnxModel,
    ranges: &HashMap<String, Range>,
    keep_fp32: &HashSet<String>,
    weights: WeightBits,
) -> Result<(OnnxModel, Rewrite), ModelError> {
    let mut m = model.clone();
    let graph_outputs: HashSet<String> = m.output_names().into_iter().collect();
    let quantizable: HashSet<String> = quantizable_convs(&m)?.into_iter().collect();
    let mut report = Rewrite::default();

    // 1. The convolutions to quantize, and the ReLUs that fold into their Q.
    let consumers = m.consumers();
    let mut quantized: Vec<usize> = Vec::new();
    let mut dropped: HashSet<usize> = HashSet::new();
    for (i, node) in m.nodes.iter().enumerate() {
        if node.op_type() != "Conv" || !node.is_onnx() {
            continue;
        }
        let name = node.name();
        if quantizable.contains(&name) && !keep_fp32.contains(&name) {
            quantized.push(i);
            report.quantized.push(name);
        } else {
            report.kept.push(name);
        }
    }
    for &c in &quantized {
        let y = m.nodes[c].outputs()[0].clone();
        if graph_outputs.contains(&y) {
            continue;
        }
        if let Some([r]) = consumers.get(&y).map(Vec::as_slice) {
            let relu = &m.nodes[*r];
            if relu.op_type() == "Relu" && relu.is_onnx() {
                let relu_out = relu.outputs()[0].clone();
                dropped.insert(*r);
                m.nodes[c].set_output(0, &relu_out);
            }
        }
    }
    report.relus_dropped = dropped.len();

    // 2. The quantized activations: what quantized convolutions read and write, grown
    // through pass-through and elementwise nodes to a fixpoint.
    let mut wanted: HashSet<String> = HashSet::new();
    for &c in &quantized {
        wanted.insert(m.nodes[c].inputs()[0].clone());
        let y = m.nodes[c].outputs()[0].clone();
        if !graph_outputs.contains(&y) {
            wanted.insert(y);
        }
    }
    let consumers = m.consumers();
    let quantized_set: HashSet<usize> = quantized.iter().copied().collect();
    loop {
        let mut grew = false;
        for (i, node) in m.nodes.iter().enumerate() {
            if dropped.contains(&i) || !node.is_onnx() {
                continue;
            }
            let op = node.op_type();
            let Some(y) = node.outputs().first().cloned() else {
                continue;
            };
            if wanted.contains(&y) || graph_outputs.contains(&y) {
                continue;
            }
            let ins = node.inputs();
            let read_by_8bit = consumers.get(&y).is_some_and(|cs| {
                cs.iter().any(|&c| {
                    quantized_set.contains(&c)
                        || PASS_THROUGH.contains(&m.nodes[c].op_type().as_str())
                        || ELEMENTWISE.contains(&m.nodes[c].op_type().as_str())
                })
            });
            let grows = if PASS_THROUGH.contains(&op.as_str()) {
                ins.first().is_some_and(|x| wanted.contains(x))
            } else {
                ELEMENTWISE.contains(&op.as_str())
                    && !ins.is_empty()
                    && ins.iter().all(|x| wanted.contains(x))
            };
            if grows && read_by_8bit {
                wanted.insert(y);
                grew = true;
            }
        }
        if !grew {
            break;
        }
    }

    // Their parameters, in graph order: a pass-through node's output shares its input's
    // (the same initializers: ONNX Runtime runs the node on the 8-bit values only when
    // the Q after it and the DQ before it name the same ones), the others have their
    // calibrated range's.
    let range_of = |t: &str| -> Result<U8Params, ModelError> {
        ranges
            .get(t)
            .map(|r| U8Params::of(*r))
            .ok_or_else(|| ModelError::Unsupported(format!("no calibrated range for tensor `{t}`")))
    };
    let mut params: HashMap<String, U8Params> = HashMap::new();
    let mut shares: HashMap<String, String> = HashMap::new();
    let mut order: Vec<String> = Vec::new();
    for x in m.input_names()? {
        if wanted.contains(&x) {
            params.insert(x.clone(), range_of(&x)?);
            order.push(x);
        }
    }
    for (i, node) in m.nodes.iter().enumerate() {
        if dropped.contains(&i) {
            continue;
        }
        for y in node.outputs() {
            if !wanted.contains(&y) || params.contains_key(&y) {
                continue;
            }
            let source = node
                .inputs()
                .first()
                .filter(|x| {
                    PASS_THROUGH.contains(&node.op_type().as_str()) && params.contains_key(*x)
                })
                .cloned();
            match source {
                Some(x) => {
                    params.insert(y.clone(), params[&x]);
                    shares.insert(y.clone(), x);
                }
                None => {
                    params.insert(y.clone(), range_of(&y)?);
                }
            }
            order.push(y);
        }
    }
    report.activations = order.len();

    // 3. The new graph: Q -> DQ after each quantized tensor's producer, the readers of the
    // tensor moved to the DQ's output; weights and biases of quantized convolutions int8
    // and int32 behind their own DQ.
    let mut names = m.names();
    let mut fresh = |stem: String| names.fresh(&stem);
    let mut new_inits: Vec<Initializer> = Vec::new();
    let mut dq_of: HashMap<String, String> = HashMap::new();
    let mut qdq_nodes: HashMap<String, [Node; 2]> = HashMap::new();
    let mut param_names: HashMap<String, (String, String)> = HashMap::new();
    for t in &order {
        let (scale, zp) = match shares.get(t).and_then(|x| param_names.get(x)) {
            Some(names) => names.clone(),
            None => {
                let p = params[t];
                let scale = fresh(format!("{t}_scale"));
                let zp = fresh(format!("{t}_zero_point"));
                new_inits.push(Initializer::f32(&scale, &[], &[p.scale]));
                new_inits.push(Initializer::u8(&zp, &[], &[p.zero_point]));
                (scale, zp)
            }
        };
        param_names.insert(t.clone(), (scale.clone(), zp.clone()));
        let q = fresh(format!("{t}_quantized"));
        let dq = fresh(format!("{t}_dequantized"));
        let qn = Node::new(
            "QuantizeLinear",
            &fresh(format!("{t}_QuantizeLinear")),
            &[t, &scale, &zp],
            &[&q],
        );
        let dqn = Node::new(
            "DequantizeLinear",
            &fresh(format!("{t}_DequantizeLinear")),
            &[&q, &scale, &zp],
            &[&dq],
        );
        dq_of.insert(t.clone(), dq);
        qdq_nodes.insert(t.clone(), [qn, dqn]);
    }
    let inits = m.initializer_index();
    let mut weight_nodes: HashMap<usize, Vec<Node>> = HashMap::new();
    for &c in &quantized {
        let node = &m.nodes[c];
        let ins = node.inputs();
        let x_scale = params[&ins[0]].scale;
        let w_init = &m.initializers[inits[&ins[1]]];
        let dims = w_init.dims()?;
        let w = w_init.floats()?.unwrap_or_default();
        let channels = dims.first().copied().unwrap_or(0).max(0) as usize;
        if channels == 0 || w.len() % channels != 0 {
            return Err(ModelError::Unsupported(format!(
                "convolution `{}`: weights of shape {dims:?}",
                node.name()
            )));
        }
        let per = w.len() / channels;
        let mut w_scale = Vec::with_capacity(channels);
        let mut w_q = Vec::with_capacity(w.len());
        for ch in w.chunks_exact(per) {
            let s = weight_scale(ch, weights);
            w_scale.push(s);
            let levels = weights.levels();
            w_q.extend(
                ch.iter()
                    .map(|v| (v / s).round().clamp(-levels, levels) as i8),
            );
        }
        let stem = node.name();
        let wq = fresh(format!("{stem}_weight_quantized"));
        let ws = fresh(format!("{stem}_weight_scale"));
        let wz = fresh(format!("{stem}_weight_zero_point"));
        let wd = fresh(format!("{stem}_weight_dequantized"));
        new_inits.push(Initializer::i8(&wq, &dims, &w_q));
        new_inits.push(Initializer::f32(&ws, &[channels as i64], &w_scale));
        new_inits.push(Initializer::i8(&wz, &[channels as i64], &vec![0; channels]));
        let mut nodes = vec![Node::new(
            "DequantizeLinear",
            &fresh(format!("{stem}_weight_DequantizeLinear")),
            &[&wq, &ws, &wz],
            &[&wd],
        )
        .with_int("axis", 0)];
        let mut rewired = vec![(1usize, wd)];
        if let Some(b_name) = ins.get(2).filter(|b| !b.is_empty()) {
            let b = m.initializers[inits[b_name]].floats()?.unwrap_or_default();
            if b.len() != channels {
                return Err(ModelError::Unsupported(format!(
                    "convolution `{stem}`: {} biases for {channels} channels",
                    b.len()
                )));
            }
            let b_scale: Vec<f32> = w_scale.iter().map(|s| s * x_scale).collect();
            let b_q: Vec<i32> = b
                .iter()
                .zip(&b_scale)
                .map(|(v, s)| (f64::from(*v) / f64::from(*s)).round() as i32)
                .collect();
            let bq = fresh(format!("{stem}_bias_quantized"));
            let bs = fresh(format!("{stem}_bias_scale"));
            let bz = fresh(format!("{stem}_bias_zero_point"));
            let bd = fresh(format!("{stem}_bias_dequantized"));
            new_inits.push(Initializer::i32(&bq, &[channels as i64], &b_q));
            new_inits.push(Initializer::f32(&bs, &[channels as i64], &b_scale));
            new_inits.push(Initializer::i32(
                &bz,
                &[channels as i64],
                &vec![0; channels],
            ));
            nodes.push(
                Node::new(
                    "DequantizeLinear",
                    &fresh(format!("{stem}_bias_DequantizeLinear")),
                    &[&bq, &bs, &bz],
                    &[&bd],
                )
                .with_int("axis", 0),
            );
            rewired.push((2, bd));
        }
        weight_nodes.insert(c, nodes);
        for (slot, name) in rewired {
            m.nodes[c].set_input(slot, &name);
        }
    }

    // Readers of a quantized tensor read its DQ (kept convolutions too: the tensor is
    // quantized because an 8-bit node writes or reads it, and what it holds is then the
    // 8-bit value).
    let mut nodes = Vec::with_capacity(m.nodes.len() + 2 * order.len());
    let graph_inputs: HashSet<String> = m.input_names()?.into_iter().collect();
    for t in &order {
        if graph_inputs.contains(t) {
            nodes.extend(qdq_nodes[t].iter().cloned());
        }
    }
    for (i, mut node) in std::mem::take(&mut m.nodes).into_iter().enumerate() {
        if dropped.contains(&i) {
            continue;
        }
        for (slot, input) in node.inputs().iter().enumerate() {
            if let Some(dq) = dq_of.get(input) {
                node.set_input(slot, dq);
            }
        }
        if let Some(w) = weight_nodes.remove(&i) {
            nodes.extend(w);
        }
        let outs = node.outputs();
        nodes.push(node);
        for y in outs {
            if let Some(pair) = qdq_nodes.get(&y) {
                nodes.extend(pair.iter().cloned());
            }
        }
    }
    m.nodes = nodes;
    m.initializers.extend(new_inits);
    // Initializers nothing reads any more (the float weights) go.
    let read: HashSet<String> = m.nodes.iter().flat_map(Node::inputs).collect();
    m.initializers.retain(|t| read.contains(&t.name()));
    Ok((m, report))
}

/// The scale of one output channel's weights on `bits`' levels: the clip of their largest magnitude,
/// from 30 % to all of it, whose rounding and clipping leave the least squared error.
/// The largest magnitude alone spends the levels on one outlier weight: on U2NetP it
/// moved the cat photo's mask by 2.0/255 on average against 1.25 with this clip.
pub fn weight_scale(weights: &[f32], bits: WeightBits) -> f32 {
    let levels = bits.levels();
    let max = weights.iter().fold(0f32, |m, v| m.max(v.abs()));
    if max <= 0.0 || !max.is_finite() {
        return 1.0;
    }
    let error = |scale: f32| -> f64 {
        weights
            .iter()
            .map(|&v| {
                let q = (v / scale).round().clamp(-levels, levels) * scale;
                f64::from(v - q).powi(2)
            })
            .sum()
    };
    (30..=100)
        .map(|percent| max * percent as f32 / 100.0 / levels)
        .map(|scale| (error(scale), scale))
        .min_by(|a, b| a.0.total_cmp(&b.0))
        .map_or(max / levels, |(_, scale)| scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prob() -> OnnxModel {
        let mut m = OnnxModel::load(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/onnx/fixtures/prob.onnx"
        )))
        .expect("fixture");
        name_nodes(&mut m);
        m
    }

    fn ranges(m: &OnnxModel) -> HashMap<String, Range> {
        measured_tensors(m)
            .expect("tensors")
            .into_iter()
            .map(|t| {
                (
                    t,
                    Range {
                        min: -4.0,
                        max: 4.0,
                    },
                )
            })
            .collect()
    }

    #[test]
    fn a_conv_gets_qdq_on_its_input_and_int8_weights() {
        let m = prob();
        assert_eq!(
            measured_tensors(&m).expect("tensors"),
            vec!["image", "logit"]
        );
        let (q, report) =
            rewrite(&m, &ranges(&m), &HashSet::new(), WeightBits::Eight).expect("rewrite");
        assert_eq!(report.quantized, vec!["Conv_0"]);
        let ops: Vec<String> = q.nodes.iter().map(Node::op_type).collect();
        assert_eq!(
            ops,
            vec![
                "QuantizeLinear",
                "DequantizeLinear",
                "DequantizeLinear",
                "DequantizeLinear",
                "Conv",
                "QuantizeLinear",
                "DequantizeLinear",
                "Sigmoid"
            ]
        );
        assert!(
            !q.initializer_index().contains_key("logit_w"),
            "float weights gone"
        );
        let wq = &q.initializers[q.initializer_index()["Conv_0_weight_quantized"]];
        assert_eq!(wq.data_type(), 3, "int8");
    }

    #[test]
    fn a_weight_scale_never_costs_more_than_the_largest_magnitudes() {
        let squared_error = |w: &[f32], scale: f32| -> f64 {
            w.iter()
                .map(|&v| f64::from(v - (v / scale).round().clamp(-127.0, 127.0) * scale).powi(2))
                .sum()
        };
        // Values that sit between the levels of the largest magnitude's scale, and on
        // the levels of a clipped one: clipping the one large value costs less.
        let mut w: Vec<f32> = (0..2000)
            .map(|i| if i % 2 == 0 { 0.5 } else { -0.5 })
            .collect();
        w.push(1.0);
        let chosen = weight_scale(&w, WeightBits::Eight);
        let largest = 1.0 / 127.0;
        assert!(squared_error(&w, chosen) <= squared_error(&w, largest));
        assert!(chosen < largest, "{chosen}");
        assert!(chosen >= 0.3 * largest - 1e-9);
        assert_eq!(
            weight_scale(&[0.0, 0.0], WeightBits::Eight),
            1.0,
            "all zero: any scale"
        );
    }

    #[test]
    fn a_kept_conv_keeps_its_float_weights() {
        let m = prob();
        let keep: HashSet<String> = ["Conv_0".to_string()].into();
        let (q, report) = rewrite(&m, &ranges(&m), &keep, WeightBits::Eight).expect("rewrite");
        assert_eq!(report.kept, vec!["Conv_0"]);
        assert!(report.quantized.is_empty());
        assert_eq!(q, m, "nothing to quantize around a float convolution");
    }
}

//! Convolutions with one output channel, split before INT8 calibration into a depthwise
//! convolution and a 1x1 convolution that sums its channels.
//!
//! Why: ONNX Runtime's CPU kernels lower a k x k convolution to im2col and a matrix
//! product whose output channels go in blocks, so a convolution with one output channel
//! costs about what one with a block of them does. U2NetP's first side output (64 -> 1
//! channels, 3x3, at 320x320) took 19.8 ms of a 162 ms INT8 run on one thread, close to
//! the 23 ms of its 128 -> 64 convolution at the same size, which does 13x the arithmetic.
//! Split, the same sum takes 3.3 ms (depthwise, a kernel of its own in ONNX Runtime) plus
//! 1.0 ms (the 1x1 sum), and the whole run 143 ms.
//!
//! The split is exact in real arithmetic (the same products, summed in another order);
//! the gate judges the variant against the FP32 model as it was, so what the new order
//! and the extra quantized tensor cost in quality is measured like any other change.

use std::collections::{HashMap, HashSet};

use super::model::{Initializer, ModelError, Node, OnnxModel};

/// Rewrites in place each Conv that has one output channel, several input channels, a
/// kernel larger than 1x1, no groups and float weights from an initializer. Returns the
/// names of the convolutions split, in graph order.
pub fn split_one_channel_convs(model: &mut OnnxModel) -> Result<Vec<String>, ModelError> {
    let index = model.initializer_index();
    let consumers = model.consumers();
    let graph_inputs: HashSet<String> = model.input_names()?.into_iter().collect();
    let mut names = model.names();
    let mut nodes = Vec::with_capacity(model.nodes.len());
    let mut added = Vec::new();
    let mut unused = HashSet::new();
    let mut split = Vec::new();
    for node in std::mem::take(&mut model.nodes) {
        let Some((weight, channels, kernel, values)) = splittable(&node, &index, model)? else {
            nodes.push(node);
            continue;
        };
        let name = node.name();
        let inputs = node.inputs();
        let output = node.outputs().first().cloned().unwrap_or_default();

        // Weights [1, C, kh, kw] and [C, 1, kh, kw] hold the same values in the same order.
        let depthwise_w = names.fresh(&format!("{weight}_depthwise"));
        added.push(Initializer::f32(
            &depthwise_w,
            &[channels, 1, kernel[0], kernel[1]],
            &values,
        ));
        let ones = names.fresh(&format!("{weight}_channel_sum"));
        added.push(Initializer::f32(
            &ones,
            &[1, channels, 1, 1],
            &vec![1.0; channels as usize],
        ));
        let per_channel = names.fresh(&format!("{output}_per_channel"));

        // Strides, pads and dilations stay with the k x k part; the sum is 1x1, stride 1.
        nodes.push(
            Node::new(
                "Conv",
                &names.fresh(&format!("{name}_depthwise")),
                &[&inputs[0], &depthwise_w],
                &[&per_channel],
            )
            .with_attributes_of(&node, &["group"])
            .with_int("group", channels),
        );
        let mut sum_inputs = vec![per_channel.as_str(), ones.as_str()];
        if let Some(bias) = inputs.get(2).filter(|b| !b.is_empty()) {
            sum_inputs.push(bias);
        }
        nodes.push(Node::new(
            "Conv",
            &names.fresh(&format!("{name}_channel_sum")),
            &sum_inputs,
            &[&output],
        ));

        let only_reader = consumers.get(&weight).is_some_and(|r| r.len() == 1);
        if only_reader && !graph_inputs.contains(&weight) {
            unused.insert(weight);
        }
        split.push(name);
    }
    model.nodes = nodes;
    model.initializers.retain(|t| !unused.contains(&t.name()));
    model.initializers.extend(added);
    Ok(split)
}

/// The weight's name, input channels, kernel size and values of a convolution the split
/// applies to.
type Splittable = (String, i64, [i64; 2], Vec<f32>);

fn splittable(
    node: &Node,
    index: &HashMap<String, usize>,
    model: &OnnxModel,
) -> Result<Option<Splittable>, ModelError> {
    if node.op_type() != "Conv" || !node.is_onnx() {
        return Ok(None);
    }
    let inputs = node.inputs();
    let Some(weight) = inputs.get(1) else {
        return Ok(None);
    };
    let Some(&at) = index.get(weight) else {
        return Ok(None);
    };
    if node.int_attribute("group")?.is_some_and(|g| g != 1) {
        return Ok(None);
    }
    let w = &model.initializers[at];
    let dims = w.dims()?;
    let [1, channels, kh, kw] = dims[..] else {
        return Ok(None);
    };
    if channels < 2 || kh * kw < 2 {
        return Ok(None);
    }
    let Some(values) = w.floats()? else {
        return Ok(None);
    };
    Ok(Some((weight.clone(), channels, [kh, kw], values)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quantize::test_support::outputs_before_and_after;

    fn prob() -> OnnxModel {
        OnnxModel::load(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("onnx/fixtures/prob.onnx"),
        )
        .expect("fixture")
    }

    /// The fixture with its 1x1 convolution replaced by a 3x3 one of uneven weights,
    /// padded, one output channel.
    fn three_by_three() -> OnnxModel {
        let mut m = prob();
        let conv = m.nodes[0].clone();
        let io = (conv.inputs(), conv.outputs());
        m.nodes[0] = Node::new("Conv", "side", &[&io.0[0], "side_w", "side_b"], &[&io.1[0]])
            .with_ints("pads", &[1, 1, 1, 1]);
        let w: Vec<f32> = (0..27).map(|i| ((i * 7 % 11) as f32 - 5.0) / 9.0).collect();
        m.initializers = vec![
            Initializer::f32("side_w", &[1, 3, 3, 3], &w),
            Initializer::f32("side_b", &[1], &[0.25]),
        ];
        m
    }

    #[test]
    fn a_one_channel_convolution_becomes_depthwise_and_a_sum_that_compute_the_same() {
        let before = three_by_three();
        let mut after = before.clone();
        let split = split_one_channel_convs(&mut after).expect("split");
        assert_eq!(split, vec!["side"]);
        let ops: Vec<(String, Option<i64>)> = after
            .nodes
            .iter()
            .map(|n| (n.op_type(), n.int_attribute("group").expect("attr")))
            .collect();
        assert_eq!(
            ops,
            vec![
                ("Conv".to_string(), Some(3)),
                ("Conv".to_string(), None),
                ("Sigmoid".to_string(), None),
            ]
        );
        assert_eq!(
            after.nodes[0].ints_attribute("pads").expect("attr"),
            Some(vec![1, 1, 1, 1])
        );
        let names: Vec<String> = after.initializers.iter().map(Initializer::name).collect();
        assert!(!names.contains(&"side_w".to_string()), "{names:?}");

        let (want, got) = outputs_before_and_after(&before, &after);
        assert_eq!(want.len(), got.len());
        let worst = want
            .iter()
            .zip(&got)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst < 1e-5, "largest difference {worst}");
        // The border, where the padding is, is covered too: not a constant output.
        assert!(want.iter().any(|&v| (v - want[0]).abs() > 0.05));
    }

    #[test]
    fn one_by_one_and_many_channel_convolutions_are_left_as_they_are() {
        // The fixture's own convolution is 1x1: nothing to gain.
        let mut m = prob();
        assert!(split_one_channel_convs(&mut m).expect("split").is_empty());
        assert_eq!(m, prob());

        // Two output channels: not this rewrite's case.
        let mut two = three_by_three();
        let w = vec![0.5; 54];
        two.initializers[0] = Initializer::f32("side_w", &[2, 3, 3, 3], &w);
        let again = two.clone();
        assert!(split_one_channel_convs(&mut two).expect("split").is_empty());
        assert_eq!(two, again);
    }
}

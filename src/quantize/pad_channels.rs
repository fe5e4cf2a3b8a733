//! Quantized convolutions that read three channels (a model's first, reading the image)
//! given a fourth input channel of zero weights, once the QDQ rewrite has made them.
//!
//! Why: ONNX Runtime's 8-bit convolution is about twice as slow on three input channels
//! as on four. Alone (QDQ 3x3 convolution to 64 channels and a max pool, 320x320, one
//! thread) it took 7.8 ms with three channels against 3.8 with four; U2NetP's INT8 run
//! went from 149 to 142 ms with its first convolution padded.
//!
//! Exact: the new channel's weights are zero, so whatever it holds adds nothing. It holds
//! the input's zero point, padded onto the 8-bit tensor (`Pad` on uint8), so the float
//! input and its quantization are as they were.

use std::collections::HashMap;

use super::model::{Initializer, ModelError, Node, OnnxModel};

/// Pads, in place, the 8-bit input of each Conv that reads a 4-D tensor of three channels
/// through a DequantizeLinear and has int8 weights behind one. Returns the names of the
/// convolutions padded.
pub fn pad_three_channel_convs(model: &mut OnnxModel) -> Result<Vec<String>, ModelError> {
    let producer: HashMap<String, usize> = model
        .nodes
        .iter()
        .enumerate()
        .flat_map(|(i, n)| n.outputs().into_iter().map(move |o| (o, i)))
        .collect();
    let consumers = model.consumers();
    let index = model.initializer_index();
    let mut names = model.names();
    // By the index of the convolution they go before: its Pad and DequantizeLinear.
    let mut before: HashMap<usize, [Node; 2]> = HashMap::new();
    let mut widened: Vec<(usize, Initializer)> = Vec::new();
    let mut added: Vec<Initializer> = Vec::new();
    let mut padded = Vec::new();
    for (c, conv) in model.nodes.iter().enumerate() {
        if conv.op_type() != "Conv" || !conv.is_onnx() {
            continue;
        }
        let inputs = conv.inputs();
        let dequantized = |at: usize| {
            let i = *inputs.get(at).and_then(|t| producer.get(t))?;
            let n = &model.nodes[i];
            (n.op_type() == "DequantizeLinear").then_some(n)
        };
        let (Some(x_dq), Some(w_dq)) = (dequantized(0), dequantized(1)) else {
            continue;
        };
        let x_dq_inputs = x_dq.inputs();
        let [x_q, scale, zero_point] = &x_dq_inputs[..] else {
            continue;
        };
        let w_name = w_dq.inputs()[0].clone();
        let Some(&w_at) = index.get(&w_name) else {
            continue;
        };
        let w = &model.initializers[w_at];
        let dims = w.dims()?;
        let [m, 3, kh, kw] = dims[..] else {
            continue;
        };
        let Some(values) = w.int8s() else {
            continue;
        };
        // The weights are read by this convolution alone (the rewrite gives each its own).
        let readers = |t: &str| consumers.get(t).map_or(0, Vec::len);
        if readers(&w_name) != 1 || readers(&w_dq.outputs()[0]) != 1 {
            continue;
        }
        let per_filter = (3 * kh * kw) as usize;
        let zeros = vec![0i8; (kh * kw) as usize];
        let four: Vec<i8> = values
            .chunks_exact(per_filter)
            .flat_map(|f| f.iter().chain(&zeros).copied())
            .collect();
        widened.push((w_at, Initializer::i8(&w_name, &[m, 4, kh, kw], &four)));

        // x_q -> Pad (one channel of x's zero point) -> DequantizeLinear -> Conv.
        let pads = names.fresh(&format!("{x_q}_pads"));
        added.push(Initializer::i64(&pads, &[8], &[0, 0, 0, 0, 0, 1, 0, 0]));
        let x_q4 = names.fresh(&format!("{x_q}_four_channels"));
        let x_dq4 = names.fresh(&format!("{x_q4}_dequantized"));
        before.insert(
            c,
            [
                Node::new(
                    "Pad",
                    &names.fresh(&format!("{}_pad_channels", conv.name())),
                    &[x_q, &pads, zero_point],
                    &[&x_q4],
                ),
                Node::new(
                    "DequantizeLinear",
                    &names.fresh(&format!("{x_q4}_DequantizeLinear")),
                    &[&x_q4, scale, zero_point],
                    &[&x_dq4],
                ),
            ],
        );
        padded.push(conv.name());
    }
    for (at, w) in widened {
        model.initializers[at] = w;
    }
    model.initializers.extend(added);
    let mut nodes = Vec::with_capacity(model.nodes.len() + 2 * padded.len());
    for (i, mut node) in std::mem::take(&mut model.nodes).into_iter().enumerate() {
        if let Some([pad, dq]) = before.remove(&i) {
            node.set_input(0, &dq.outputs()[0]);
            nodes.push(pad);
            nodes.push(dq);
        }
        nodes.push(node);
    }
    model.nodes = nodes;
    Ok(padded)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quantize::qdq::{measured_tensors, name_nodes, rewrite};
    use crate::quantize::ranges::Range;
    use crate::quantize::test_support::outputs_before_and_after;
    use crate::quantize::weights::WeightBits;
    use std::collections::HashSet;

    /// The fixture (a 1x1 convolution of the image's three channels, then a sigmoid) in
    /// QDQ form.
    fn quantized_prob() -> OnnxModel {
        let mut m = OnnxModel::load(
            &std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("onnx/fixtures/prob.onnx"),
        )
        .expect("fixture");
        name_nodes(&mut m);
        let ranges = measured_tensors(&m)
            .expect("tensors")
            .into_iter()
            .map(|t| {
                let r = if t == "image" {
                    Range { min: 0.0, max: 1.0 }
                } else {
                    Range {
                        min: -4.0,
                        max: 4.0,
                    }
                };
                (t, r)
            })
            .collect();
        rewrite(&m, &ranges, &HashSet::new(), WeightBits::for_this_cpu())
            .expect("rewrite")
            .0
    }

    #[test]
    fn a_three_channel_convolution_reads_a_fourth_zero_weighted_channel_and_computes_the_same() {
        let before = quantized_prob();
        let mut after = before.clone();
        assert_eq!(
            pad_three_channel_convs(&mut after).expect("pad"),
            vec!["Conv_0"]
        );
        let ops: Vec<String> = after.nodes.iter().map(Node::op_type).collect();
        let pad = ops.iter().position(|o| o == "Pad").expect("a Pad");
        assert_eq!(ops[pad + 1], "DequantizeLinear");
        assert_eq!(ops[pad + 2], "Conv", "{ops:?}");
        let conv = &after.nodes[pad + 2];
        let index = after.initializer_index();
        let w_dq = after
            .nodes
            .iter()
            .find(|n| n.outputs()[0] == conv.inputs()[1])
            .expect("the weights' DequantizeLinear");
        let w = &after.initializers[index[&w_dq.inputs()[0]]];
        assert_eq!(w.dims().expect("dims"), vec![1, 4, 1, 1]);
        assert_eq!(
            w.int8s().expect("int8")[3],
            0,
            "the fourth channel's weight"
        );

        let (want, got) = outputs_before_and_after(&before, &after);
        assert_eq!(want, got);
        assert!(want.iter().any(|&v| (v - want[0]).abs() > 0.05));

        // Once padded, nothing is left to pad.
        let mut again = after.clone();
        assert!(pad_three_channel_convs(&mut again).expect("pad").is_empty());
        assert_eq!(again, after);
    }
}

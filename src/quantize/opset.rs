//! Raising a model's ONNX operator set to 13, the first where DequantizeLinear takes a
//! per-channel scale (`axis`). From 11 and 12 only: the operators whose form changed on
//! the way are rewritten (Unsqueeze's and Squeeze's `axes` became an input), the others
//! that changed (Split, ReduceSum) are refused by name rather than guessed at; the rest
//! of 13's changes only add element types.

use super::model::{Initializer, ModelError, OnnxModel};

/// The operator set QDQ with per-channel weights needs.
pub const QDQ_OPSET: u64 = 13;
/// The IR version that goes with operator set 13 (ONNX 1.8).
const IR_FOR_QDQ: u64 = 7;

/// What raising the operator set did, for the build's report.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Raised {
    pub from: u64,
    pub to: u64,
    /// Nodes rewritten to the newer form.
    pub rewritten: usize,
}

/// Raises `model` to operator set 13 if it is below it.
pub fn raise_for_qdq(model: &mut OnnxModel) -> Result<Raised, ModelError> {
    let from = model.opset()?;
    if from >= QDQ_OPSET {
        return Ok(Raised {
            from,
            to: from,
            rewritten: 0,
        });
    }
    if from < 11 {
        return Err(ModelError::Unsupported(format!(
            "operator set {from}: celer raises models from 11 or 12 to 13 for QDQ; \
             convert it to 13 first (onnx.version_converter)"
        )));
    }
    let mut names = model.names();
    let mut added = Vec::new();
    let mut rewritten = 0;
    for node in &mut model.nodes {
        if !node.is_onnx() {
            continue;
        }
        match node.op_type().as_str() {
            "Unsqueeze" | "Squeeze" => {
                let Some(axes) = node.ints_attribute("axes")? else {
                    continue;
                };
                let stem = format!(
                    "{}_axes",
                    node.outputs().first().cloned().unwrap_or_default()
                );
                let name = names.fresh(&stem);
                node.remove_attribute("axes");
                node.push_input(&name);
                added.push(Initializer::i64(&name, &[axes.len() as i64], &axes));
                rewritten += 1;
            }
            op @ ("Split" | "ReduceSum") => {
                return Err(ModelError::Unsupported(format!(
                    "node `{}` ({op}) changed form in operator set 13 and celer does not \
                     convert it; convert the model to 13 first (onnx.version_converter)",
                    node.name()
                )));
            }
            _ => {}
        }
    }
    model.initializers.extend(added);
    model.set_opset(QDQ_OPSET)?;
    if model.ir_version() < IR_FOR_QDQ {
        model.set_ir_version(IR_FOR_QDQ);
    }
    Ok(Raised {
        from,
        to: QDQ_OPSET,
        rewritten,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quantize::model::Node;

    #[test]
    fn unsqueeze_axes_become_an_input_at_opset_13() {
        let mut m = OnnxModel::decode(
            &std::fs::read(concat!(
                env!("CARGO_MANIFEST_DIR"),
                "/onnx/fixtures/prob.onnx"
            ))
            .expect("fixture"),
        )
        .expect("decode");
        m.set_opset(11).expect("opset");
        let mut u = Node::new("Unsqueeze", "u", &["mask"], &["mask4"]);
        let mut attr = crate::quantize::proto::Message::default();
        attr.push_string(1, "axes")
            .push_packed_ints(8, &[0])
            .push_varint(20, 7);
        u.0.push_message(5, &attr);
        m.nodes.push(u);
        let raised = raise_for_qdq(&mut m).expect("raise");
        assert_eq!((raised.from, raised.to, raised.rewritten), (11, 13, 1));
        let u = m.nodes.last().expect("node");
        assert_eq!(u.inputs(), vec!["mask", "mask4_axes"]);
        assert_eq!(u.ints_attribute("axes").expect("attrs"), None);
        let axes = &m.initializers[m.initializer_index()["mask4_axes"]];
        assert_eq!(axes.dims().expect("dims"), vec![1]);
        assert_eq!(m.opset().expect("opset"), 13);
    }
}

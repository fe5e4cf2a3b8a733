//! An ONNX model as the quantizer edits it: the graph's nodes, initializers and outputs
//! taken apart, everything else kept as read (`proto`). Field numbers are onnx.proto's
//! (IR version 10); only those celer reads or writes are named here.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use super::proto::{Message, WireError};

// ModelProto
const MODEL_IR_VERSION: u32 = 1;
const MODEL_GRAPH: u32 = 7;
const MODEL_OPSET_IMPORT: u32 = 8;
// OperatorSetIdProto
const OPSET_DOMAIN: u32 = 1;
const OPSET_VERSION: u32 = 2;
// GraphProto
const GRAPH_NODE: u32 = 1;
const GRAPH_INITIALIZER: u32 = 5;
const GRAPH_INPUT: u32 = 11;
const GRAPH_OUTPUT: u32 = 12;
const GRAPH_VALUE_INFO: u32 = 13;
// NodeProto
const NODE_INPUT: u32 = 1;
const NODE_OUTPUT: u32 = 2;
const NODE_NAME: u32 = 3;
const NODE_OP_TYPE: u32 = 4;
const NODE_ATTRIBUTE: u32 = 5;
const NODE_DOMAIN: u32 = 7;
// AttributeProto
const ATTR_NAME: u32 = 1;
const ATTR_I: u32 = 3;
const ATTR_T: u32 = 5;
const ATTR_INTS: u32 = 8;
const ATTR_TYPE: u32 = 20;
const ATTR_TYPE_INT: u64 = 2;
const ATTR_TYPE_INTS: u64 = 7;
// TensorProto
const TENSOR_DIMS: u32 = 1;
const TENSOR_DATA_TYPE: u32 = 2;
const TENSOR_FLOAT_DATA: u32 = 4;
const TENSOR_NAME: u32 = 8;
const TENSOR_RAW_DATA: u32 = 9;
const TENSOR_DATA_LOCATION: u32 = 14;
// ValueInfoProto, TypeProto, TypeProto.Tensor
const VALUE_NAME: u32 = 1;
const VALUE_TYPE: u32 = 2;
const TYPE_TENSOR: u32 = 1;
const TENSOR_TYPE_ELEM: u32 = 1;

/// TensorProto.DataType values celer writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataType {
    Float = 1,
    Uint8 = 2,
    Int8 = 3,
    Int32 = 6,
    Int64 = 7,
    Float16 = 10,
}

/// Why a file is not an ONNX model celer can edit.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("cannot read {path}: {error}")]
    Read { path: String, error: std::io::Error },
    #[error("{0}")]
    Wire(#[from] WireError),
    #[error("{0}")]
    Unsupported(String),
}

/// One node: its message, read through accessors so that its fields keep their order.
#[derive(Debug, Clone, PartialEq)]
pub struct Node(pub Message);

impl Node {
    pub fn new(op_type: &str, name: &str, inputs: &[&str], outputs: &[&str]) -> Self {
        let mut m = Message::default();
        for i in inputs {
            m.push_string(NODE_INPUT, i);
        }
        for o in outputs {
            m.push_string(NODE_OUTPUT, o);
        }
        m.push_string(NODE_NAME, name)
            .push_string(NODE_OP_TYPE, op_type);
        Self(m)
    }

    /// With an integer attribute `name = value`.
    pub fn with_int(mut self, name: &str, value: i64) -> Self {
        let mut a = Message::default();
        a.push_string(ATTR_NAME, name)
            .push_varint(ATTR_I, value as u64)
            .push_varint(ATTR_TYPE, ATTR_TYPE_INT);
        self.0.push_message(NODE_ATTRIBUTE, &a);
        self
    }

    /// With an integer list attribute `name = values`.
    pub fn with_ints(mut self, name: &str, values: &[i64]) -> Self {
        let mut a = Message::default();
        a.push_string(ATTR_NAME, name)
            .push_packed_ints(ATTR_INTS, values)
            .push_varint(ATTR_TYPE, ATTR_TYPE_INTS);
        self.0.push_message(NODE_ATTRIBUTE, &a);
        self
    }

    /// With `other`'s attributes, but those named in `except`.
    pub fn with_attributes_of(mut self, other: &Node, except: &[&str]) -> Self {
        let copied = other
            .0
            .fields
            .iter()
            .filter(|f| f.number == NODE_ATTRIBUTE && !attribute_named(f, except));
        self.0.fields.extend(copied.cloned());
        self
    }

    pub fn op_type(&self) -> String {
        self.0.string(NODE_OP_TYPE)
    }

    pub fn name(&self) -> String {
        self.0.string(NODE_NAME)
    }

    /// The operator's domain; "" (or "ai.onnx") is ONNX's own.
    pub fn domain(&self) -> String {
        self.0.string(NODE_DOMAIN)
    }

    /// Whether it is one of ONNX's own operators (not a runtime's contrib domain).
    pub fn is_onnx(&self) -> bool {
        is_onnx_domain(&self.domain())
    }

    pub fn inputs(&self) -> Vec<String> {
        self.0.strings(NODE_INPUT)
    }

    pub fn outputs(&self) -> Vec<String> {
        self.0.strings(NODE_OUTPUT)
    }

    pub fn set_input(&mut self, index: usize, name: &str) {
        self.0.replace_string_at(NODE_INPUT, index, name);
    }

    pub fn set_output(&mut self, index: usize, name: &str) {
        self.0.replace_string_at(NODE_OUTPUT, index, name);
    }

    pub fn push_input(&mut self, name: &str) {
        // Inputs come first in a node; a new one goes after the last.
        let at = self
            .0
            .fields
            .iter()
            .rposition(|f| f.number == NODE_INPUT)
            .map_or(0, |i| i + 1);
        let mut field = Message::default();
        field.push_string(NODE_INPUT, name);
        self.0.fields.insert(at, field.fields.remove(0));
    }

    fn attributes(&self) -> Result<Vec<Message>, WireError> {
        self.0.messages(NODE_ATTRIBUTE)
    }

    /// The integer list attribute `name`, if the node has it.
    pub fn ints_attribute(&self, name: &str) -> Result<Option<Vec<i64>>, WireError> {
        for a in self.attributes()? {
            if a.string(ATTR_NAME) == name {
                return a.ints(ATTR_INTS).map(Some);
            }
        }
        Ok(None)
    }

    /// The integer attribute `name`, if the node has it.
    pub fn int_attribute(&self, name: &str) -> Result<Option<i64>, WireError> {
        Ok(self
            .attributes()?
            .into_iter()
            .find(|a| a.string(ATTR_NAME) == name)
            .map(|a| a.varint(ATTR_I) as i64))
    }

    /// Sets integer attribute `name` (which the node must have) to `value`.
    pub fn set_int_attribute(&mut self, name: &str, value: i64) -> Result<bool, WireError> {
        self.edit_attribute(name, |a| a.set_varint(ATTR_I, value as u64))
    }

    /// The tensor attribute `name` (a Constant's `value`), if the node has it.
    pub fn tensor_attribute(&self, name: &str) -> Result<Option<Initializer>, WireError> {
        for a in self.attributes()? {
            if a.string(ATTR_NAME) == name {
                return Ok(match a.bytes(ATTR_T).last() {
                    Some(t) => Some(Initializer(Message::decode(t)?)),
                    None => None,
                });
            }
        }
        Ok(None)
    }

    /// Replaces tensor attribute `name` (which the node must have) with `tensor`.
    pub fn set_tensor_attribute(
        &mut self,
        name: &str,
        tensor: &Initializer,
    ) -> Result<bool, WireError> {
        self.edit_attribute(name, |a| {
            a.clear(ATTR_T);
            a.push_message(ATTR_T, &tensor.0);
        })
    }

    /// Applies `edit` to attribute `name` in place; whether the node has it.
    fn edit_attribute(
        &mut self,
        name: &str,
        edit: impl Fn(&mut Message),
    ) -> Result<bool, WireError> {
        for field in &mut self.0.fields {
            if field.number != NODE_ATTRIBUTE {
                continue;
            }
            if let super::proto::Value::Bytes(b) = &field.value {
                let mut a = Message::decode(b)?;
                if a.string(ATTR_NAME) == name {
                    edit(&mut a);
                    field.value = super::proto::Value::Bytes(a.encode());
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    /// Removes attribute `name`; whether it was there.
    pub fn remove_attribute(&mut self, name: &str) -> bool {
        let before = self.0.fields.len();
        self.0
            .fields
            .retain(|f| !(f.number == NODE_ATTRIBUTE && attribute_named(f, &[name])));
        self.0.fields.len() != before
    }
}

/// Whether a node's attribute field names one of `names`.
fn attribute_named(field: &super::proto::Field, names: &[&str]) -> bool {
    match &field.value {
        super::proto::Value::Bytes(b) => {
            Message::decode(b).is_ok_and(|a| names.contains(&a.string(ATTR_NAME).as_str()))
        }
        _ => false,
    }
}

/// An initializer: a named constant tensor.
#[derive(Debug, Clone, PartialEq)]
pub struct Initializer(pub Message);

impl Initializer {
    fn with(name: &str, dims: &[i64], data_type: DataType, raw: Vec<u8>) -> Self {
        let mut m = Message::default();
        m.push_packed_ints(TENSOR_DIMS, dims)
            .push_varint(TENSOR_DATA_TYPE, data_type as u64)
            .push_string(TENSOR_NAME, name)
            .push_bytes(TENSOR_RAW_DATA, raw);
        Self(m)
    }

    pub fn f32(name: &str, dims: &[i64], data: &[f32]) -> Self {
        Self::with(
            name,
            dims,
            DataType::Float,
            bytemuck::cast_slice(data).to_vec(),
        )
    }

    pub fn u8(name: &str, dims: &[i64], data: &[u8]) -> Self {
        Self::with(name, dims, DataType::Uint8, data.to_vec())
    }

    pub fn i8(name: &str, dims: &[i64], data: &[i8]) -> Self {
        Self::with(
            name,
            dims,
            DataType::Int8,
            bytemuck::cast_slice(data).to_vec(),
        )
    }

    pub fn i32(name: &str, dims: &[i64], data: &[i32]) -> Self {
        Self::with(
            name,
            dims,
            DataType::Int32,
            bytemuck::cast_slice(data).to_vec(),
        )
    }

    pub fn i64(name: &str, dims: &[i64], data: &[i64]) -> Self {
        Self::with(
            name,
            dims,
            DataType::Int64,
            bytemuck::cast_slice(data).to_vec(),
        )
    }

    pub fn f16(name: &str, dims: &[i64], data: &[half::f16]) -> Self {
        Self::with(
            name,
            dims,
            DataType::Float16,
            data.iter().flat_map(|v| v.to_le_bytes()).collect(),
        )
    }

    pub fn name(&self) -> String {
        self.0.string(TENSOR_NAME)
    }

    pub fn dims(&self) -> Result<Vec<i64>, WireError> {
        self.0.ints(TENSOR_DIMS)
    }

    pub fn data_type(&self) -> u64 {
        self.0.varint(TENSOR_DATA_TYPE)
    }

    /// The same tensor (name, dims) with its values as float16, if it is a float32
    /// tensor stored in the file. Values beyond float16's range saturate at its largest
    /// finite value rather than becoming infinite.
    pub fn to_f16(&self) -> Result<Option<Initializer>, WireError> {
        let Some(values) = self.floats()? else {
            return Ok(None);
        };
        let max = half::f16::MAX.to_f32();
        let data: Vec<half::f16> = values
            .iter()
            .map(|&v| half::f16::from_f32(if v.is_finite() { v.clamp(-max, max) } else { v }))
            .collect();
        Ok(Some(Self::f16(&self.name(), &self.dims()?, &data)))
    }

    /// Its values, if it is an int8 tensor stored as raw data (as celer writes them).
    pub fn int8s(&self) -> Option<Vec<i8>> {
        if self.data_type() != DataType::Int8 as u64 || self.0.varint(TENSOR_DATA_LOCATION) != 0 {
            return None;
        }
        let raw = self.0.bytes(TENSOR_RAW_DATA).last()?;
        Some(bytemuck::cast_slice(raw).to_vec())
    }

    /// Its values, if it is a float32 tensor stored in the file.
    pub fn floats(&self) -> Result<Option<Vec<f32>>, WireError> {
        if self.data_type() != DataType::Float as u64 || self.0.varint(TENSOR_DATA_LOCATION) != 0 {
            return Ok(None);
        }
        if let Some(raw) = self.0.bytes(TENSOR_RAW_DATA).last() {
            if raw.len() % 4 != 0 {
                return Err(WireError("raw float data not a multiple of 4 bytes".into()));
            }
            return Ok(Some(
                raw.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ));
        }
        self.0.floats(TENSOR_FLOAT_DATA).map(Some)
    }
}

/// ONNX's own operator set: "" or its full name.
fn is_onnx_domain(domain: &str) -> bool {
    matches!(domain, "" | "ai.onnx")
}

/// The names a graph uses, and new ones that clash with none of them.
#[derive(Debug, Clone, Default)]
pub struct Names(pub HashSet<String>);

impl Names {
    /// `stem` if unused, else the first unused `stem_1`, `stem_2`, ...; taken from now on.
    pub fn fresh(&mut self, stem: &str) -> String {
        let name = if self.0.contains(stem) {
            (1..)
                .map(|i| format!("{stem}_{i}"))
                .find(|n| !self.0.contains(n))
                .unwrap_or_else(|| stem.to_string())
        } else {
            stem.to_string()
        };
        self.0.insert(name.clone());
        name
    }
}

/// A ValueInfoProto's tensor element type (0 when it states none).
fn value_elem_type(v: &Message) -> Result<u64, ModelError> {
    let Some(ty) = v.messages(VALUE_TYPE)?.pop() else {
        return Ok(0);
    };
    let Some(tensor) = ty.messages(TYPE_TENSOR)?.pop() else {
        return Ok(0);
    };
    Ok(tensor.varint(TENSOR_TYPE_ELEM))
}

/// An ONNX model, its graph taken apart.
#[derive(Debug, Clone, PartialEq)]
pub struct OnnxModel {
    /// The model's fields but the graph.
    pub rest: Message,
    /// The graph's fields but its nodes, initializers and outputs.
    pub graph_rest: Message,
    pub nodes: Vec<Node>,
    pub initializers: Vec<Initializer>,
    /// ValueInfoProto of each graph output.
    pub outputs: Vec<Message>,
}

impl OnnxModel {
    pub fn load(path: &Path) -> Result<Self, ModelError> {
        let bytes = std::fs::read(path).map_err(|error| ModelError::Read {
            path: path.display().to_string(),
            error,
        })?;
        Self::decode(&bytes)
    }

    pub fn decode(bytes: &[u8]) -> Result<Self, ModelError> {
        let mut rest = Message::decode(bytes)?;
        let graph = rest
            .bytes(MODEL_GRAPH)
            .last()
            .ok_or_else(|| ModelError::Unsupported("the model has no graph".into()))?
            .to_vec();
        rest.clear(MODEL_GRAPH);
        let mut graph_rest = Message::decode(&graph)?;
        let nodes = graph_rest
            .messages(GRAPH_NODE)?
            .into_iter()
            .map(Node)
            .collect();
        let initializers = graph_rest
            .messages(GRAPH_INITIALIZER)?
            .into_iter()
            .map(Initializer)
            .collect();
        let outputs = graph_rest.messages(GRAPH_OUTPUT)?;
        for n in [GRAPH_NODE, GRAPH_INITIALIZER, GRAPH_OUTPUT] {
            graph_rest.clear(n);
        }
        Ok(Self {
            rest,
            graph_rest,
            nodes,
            initializers,
            outputs,
        })
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut graph = self.graph_rest.clone();
        for n in &self.nodes {
            graph.push_message(GRAPH_NODE, &n.0);
        }
        for i in &self.initializers {
            graph.push_message(GRAPH_INITIALIZER, &i.0);
        }
        for o in &self.outputs {
            graph.push_message(GRAPH_OUTPUT, o);
        }
        let mut model = self.rest.clone();
        model.push_message(MODEL_GRAPH, &graph);
        model.encode()
    }

    pub fn save(&self, path: &Path) -> std::io::Result<()> {
        crate::host::atomic_write::write_atomically(path, &self.encode())
    }

    pub fn ir_version(&self) -> u64 {
        self.rest.varint(MODEL_IR_VERSION)
    }

    pub fn set_ir_version(&mut self, v: u64) {
        self.rest.set_varint(MODEL_IR_VERSION, v);
    }

    /// The version of ONNX's own operator set the model imports.
    pub fn opset(&self) -> Result<u64, ModelError> {
        for o in self.rest.messages(MODEL_OPSET_IMPORT)? {
            if is_onnx_domain(&o.string(OPSET_DOMAIN)) {
                return Ok(o.varint(OPSET_VERSION));
            }
        }
        Err(ModelError::Unsupported(
            "the model imports no ONNX operator set".into(),
        ))
    }

    /// Sets the version of ONNX's own operator set, the other imports kept.
    pub fn set_opset(&mut self, version: u64) -> Result<(), ModelError> {
        let mut imports = self.rest.messages(MODEL_OPSET_IMPORT)?;
        self.rest.clear(MODEL_OPSET_IMPORT);
        let mut found = false;
        for o in &mut imports {
            if is_onnx_domain(&o.string(OPSET_DOMAIN)) {
                o.set_varint(OPSET_VERSION, version);
                found = true;
            }
        }
        if !found {
            let mut o = Message::default();
            o.push_string(OPSET_DOMAIN, "")
                .push_varint(OPSET_VERSION, version);
            imports.push(o);
        }
        for o in &imports {
            self.rest.push_message(MODEL_OPSET_IMPORT, o);
        }
        Ok(())
    }

    /// The names of the graph's inputs.
    pub fn input_names(&self) -> Result<Vec<String>, ModelError> {
        Ok(self
            .graph_rest
            .messages(GRAPH_INPUT)?
            .iter()
            .map(|v| v.string(VALUE_NAME))
            .collect())
    }

    /// The graph's inputs whose element type is float32.
    pub fn float_input_names(&self) -> Result<Vec<String>, ModelError> {
        let mut names = Vec::new();
        for v in self.graph_rest.messages(GRAPH_INPUT)? {
            if value_elem_type(&v)? == DataType::Float as u64 {
                names.push(v.string(VALUE_NAME));
            }
        }
        Ok(names)
    }

    /// The element type of each graph output, by position.
    pub fn output_elem_types(&self) -> Result<Vec<u64>, ModelError> {
        self.outputs.iter().map(value_elem_type).collect()
    }

    /// Drops the graph's recorded intermediate types (value_info): a conversion that
    /// changes types leaves them to the runtime's inference instead of stale.
    pub fn clear_value_info(&mut self) {
        self.graph_rest.clear(GRAPH_VALUE_INFO);
    }

    pub fn output_names(&self) -> Vec<String> {
        self.outputs.iter().map(|v| v.string(VALUE_NAME)).collect()
    }

    /// Adds `name` as a float32 graph output of unstated shape (calibration reads every
    /// activation it measures this way).
    pub fn add_float_output(&mut self, name: &str) {
        let mut tensor = Message::default();
        tensor.push_varint(TENSOR_TYPE_ELEM, DataType::Float as u64);
        let mut ty = Message::default();
        ty.push_message(TYPE_TENSOR, &tensor);
        let mut value = Message::default();
        value
            .push_string(VALUE_NAME, name)
            .push_message(VALUE_TYPE, &ty);
        self.outputs.push(value);
    }

    /// Initializers by name.
    pub fn initializer_index(&self) -> HashMap<String, usize> {
        self.initializers
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name(), i))
            .collect()
    }

    /// For each tensor, the nodes (by index) that read it.
    pub fn consumers(&self) -> HashMap<String, Vec<usize>> {
        let mut map: HashMap<String, Vec<usize>> = HashMap::new();
        for (i, n) in self.nodes.iter().enumerate() {
            for input in n.inputs() {
                if !input.is_empty() {
                    map.entry(input).or_default().push(i);
                }
            }
        }
        map
    }

    /// Every tensor, initializer and node name the graph uses, from which `Names::fresh`
    /// makes new ones.
    pub fn names(&self) -> Names {
        let mut taken: HashSet<String> = self.initializers.iter().map(Initializer::name).collect();
        for n in &self.nodes {
            taken.extend(n.inputs());
            taken.extend(n.outputs());
            taken.insert(n.name());
        }
        Names(taken)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> OnnxModel {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("onnx/fixtures")
            .join(name);
        OnnxModel::load(&path).expect("fixture loads")
    }

    #[test]
    fn the_fixture_reads_as_its_generator_wrote_it() {
        let m = fixture("prob.onnx");
        assert_eq!(m.opset().expect("opset"), 17);
        let ops: Vec<String> = m.nodes.iter().map(Node::op_type).collect();
        assert_eq!(ops, vec!["Conv", "Sigmoid"]);
        assert_eq!(m.output_names(), vec!["mask"]);
        let w = &m.initializers[m.initializer_index()["logit_w"]];
        assert_eq!(w.dims().expect("dims"), vec![1, 3, 1, 1]);
        let values = w.floats().expect("floats").expect("f32");
        assert!(values.iter().all(|&v| (v - 8.0 / 3.0).abs() < 1e-6));
    }

    #[test]
    fn decoding_and_encoding_changes_nothing_a_reader_sees() {
        let m = fixture("matting.onnx");
        let again = OnnxModel::decode(&m.encode()).expect("decode");
        assert_eq!(again, m);
    }
}

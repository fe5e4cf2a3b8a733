//! The pipeline's two models as the description gives them (file, inputs, output), their
//! contracts, and their ONNX Runtime sessions loaded and checked against those contracts.
//! The CPU replica runs these sessions; a GPU replica runs them where TensorRT is absent,
//! and otherwise checks its engines against the same contracts (`gpu::model`).

use std::path::Path;

use super::contract::{ContractError, Declared, Element, ModelContract};
use crate::ort::session::{OpThreads, OrtModel, TensorDescription};
use crate::ort::OrtError;
use crate::spec::{ImageInputSpec, MattingSpec, PipelineSpec};

/// One model of the pipeline: its file, what the pipeline feeds it and what it reads.
#[derive(Debug, Clone)]
pub struct ModelSpec<'a> {
    pub path: &'a Path,
    /// Inputs by name with their `[1, C, H, W]` shapes.
    pub inputs: Vec<(&'a str, [usize; 4])>,
    pub output: &'a str,
}

/// Why a model could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Backend(#[from] OrtError),
    #[error(transparent)]
    Contract(#[from] ContractError),
}

/// `[1, channels, height, width]` of an image input.
pub fn nchw(spec: &ImageInputSpec, channels: usize) -> [usize; 4] {
    [1, channels, spec.height as usize, spec.width as usize]
}

/// The segmentation model: the image in, the mask (or class scores) out.
pub fn segmentation(spec: &PipelineSpec) -> ModelSpec<'_> {
    let seg = &spec.segmentation;
    ModelSpec {
        path: &seg.image.model,
        inputs: vec![(seg.image.input.as_str(), nchw(&seg.image, 3))],
        output: &seg.output,
    }
}

/// The matting model (image and trimap in, alpha out); `None` with the guided filter.
pub fn matting(spec: &PipelineSpec) -> Option<ModelSpec<'_>> {
    match &spec.matting {
        MattingSpec::Model {
            image,
            trimap_input,
            output,
        } => Some(matting_model(image, trimap_input, output)),
        MattingSpec::GuidedFilter { .. } => None,
    }
}

/// The matting model of a `MattingSpec::Model` with these fields: the image (`image`'s
/// input) and the trimap (`trimap_input`, one channel at the image's size) in, `output`
/// out.
pub fn matting_model<'a>(
    image: &'a ImageInputSpec,
    trimap_input: &'a str,
    output: &'a str,
) -> ModelSpec<'a> {
    ModelSpec {
        path: &image.model,
        inputs: vec![
            (image.input.as_str(), nchw(image, 3)),
            (trimap_input, nchw(image, 1)),
        ],
        output,
    }
}

/// What ONNX Runtime feeds and reads in celer: float32.
const ORT_ELEMENTS: &[Element] = &[Element::F32];

impl ModelSpec<'_> {
    /// The contract for a runtime that handles `elements`, `label` naming the model.
    pub fn contract<'a>(&'a self, label: &'a str, elements: &'a [Element]) -> ModelContract<'a> {
        ModelContract {
            label,
            inputs: &self.inputs,
            output: self.output,
            elements,
        }
    }

    /// An ONNX Runtime session of the model on `threads`, checked against its contract.
    pub fn load_ort(&self, threads: impl Into<OpThreads>) -> Result<OrtModel, ModelError> {
        let model = OrtModel::load(self.path, threads)?;
        let declared: Vec<Declared> = model
            .inputs()
            .iter()
            .map(|d| declared(d, true))
            .chain(model.outputs().iter().map(|d| declared(d, false)))
            .collect();
        self.contract(model.label(), ORT_ELEMENTS)
            .check(&declared)?;
        Ok(model)
    }
}

fn declared(d: &TensorDescription, is_input: bool) -> Declared {
    Declared {
        name: d.name.clone(),
        is_input,
        element: match d.element_type.as_str() {
            "Float32" => Element::F32,
            "Float16" => Element::F16,
            other => Element::Other(other.to_string()),
        },
        shape: d.shape.clone(),
    }
}

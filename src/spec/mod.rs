//! The pipeline description of a model directory (`celer.toml`): the vocabulary every
//! layer speaks (models, input normalisation, trimap, matting, output kinds, batching),
//! parsed and validated. The ground floor: it imports nothing of celer's and never opens a
//! model, a device or a socket.

mod describe;
mod pipeline;

use std::path::PathBuf;

pub use pipeline::{
    BatchingSpec, ImageInputSpec, MaskKind, MattingSpec, ModelPrecision, Normalize, OutputKind,
    PipelineSpec, Scale, SegmentationSpec, TrimapSpec, UnknownOutputKind, MATTING_MODEL,
    PIPELINE_FILE, SEGMENTATION_MODEL,
};

/// A configuration problem, said so that the operator can fix it without reading code:
/// which file, which key, what was expected.
#[derive(Debug, thiserror::Error)]
pub enum SpecError {
    #[error("cannot read {}: {reason}", file.display())]
    Read { file: PathBuf, reason: String },
    #[error("{}{}: {message}{}", file.display(), line.map(|l| format!(" line {l}")).unwrap_or_default(), key.as_ref().map(|k| format!(" (key `{k}`)")).unwrap_or_default())]
    Parse {
        file: PathBuf,
        message: String,
        key: Option<String>,
        line: Option<usize>,
    },
    #[error("{}: key `{key}`: expected {expected}", file.display())]
    Invalid {
        file: PathBuf,
        key: String,
        expected: String,
    },
    #[error("{}: key `{key}`: model file {} does not exist{hint}", file.display(), model.display())]
    MissingModel {
        file: PathBuf,
        key: String,
        model: PathBuf,
        hint: String,
    },
}

//! Configuration: the pipeline description of a model directory (`celer.toml`) and the
//! options of each command. This module validates; it never opens a model or a socket.

mod conn;
pub mod cpus;
mod describe;
pub mod hosting;
mod pipeline;
mod serve;

use std::path::PathBuf;

pub use conn::{ConnArgs, ConnLimits};
pub use hosting::{HostingMode, HostingPlan};
pub use pipeline::{
    BatchingSpec, ImageInputSpec, MaskKind, MattingSpec, Normalize, OutputKind, PipelineSpec,
    Scale, SegmentationSpec, TrimapSpec, MATTING_MODEL, PIPELINE_FILE, SEGMENTATION_MODEL,
};
pub use serve::{DeviceArgs, RequestLimits, RuntimeArgs, ServeArgs};

/// A configuration problem, said so that the operator can fix it without reading code:
/// which file, which key, what was expected.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
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

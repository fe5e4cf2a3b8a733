//! Reduced-precision variants of a pipeline's models, made offline by `celer build
//! --precision`: the ONNX file edited in place of the wire format (`proto`, `model`), its
//! operator set raised where QDQ needs it (`opset`), INT8 calibrated on the user's images
//! (`ranges`, `images`) and rewritten to QDQ (`qdq`), its one-output-channel convolutions
//! split first and three-channel ones padded after (`one_channel`, `pad_channels`: exact
//! rewrites for the CPU's kernels), with the nodes that cost the most
//! quality kept in FP32 (`int8`), FP16 converted (`fp16`), each held to the quality gate
//! on held-out images (`gate`) and recorded in a manifest beside it (`variant`). Nothing
//! here runs on the request path: serving only reads the manifest and the file.

pub mod calibrate;
pub mod fp16;
pub mod gate;
pub mod images;
pub mod int8;
pub mod judge;
pub mod model;
pub mod one_channel;
pub mod opset;
pub mod pad_channels;
pub mod proto;
pub mod qdq;
pub mod ranges;
pub mod search;
pub mod variant;
pub mod weights;

use std::path::PathBuf;

use crate::ort::OrtError;
use crate::replica::cpu::CpuError;

/// Why a variant was not written.
#[derive(Debug, thiserror::Error)]
pub enum QuantizeError {
    #[error("{}: {error}", path.display())]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{}: {reason}", dir.display())]
    Images { dir: PathBuf, reason: String },
    #[error(transparent)]
    Model(#[from] model::ModelError),
    #[error(transparent)]
    Ort(#[from] OrtError),
    #[error("the pipeline: {0}")]
    Pipeline(#[from] CpuError),
    #[error("{0}")]
    Unsupported(String),
    /// The variant is below the gate on the validation images: not written.
    #[error("the variant is below the quality gate on the validation images; not written\n{}", report.table())]
    GateFailed { report: Box<gate::GateReport> },
}

/// What the exact rewrites' tests share: a model of the `prob.onnx` fixture's interface
/// (`image` 1x3x64x64 in, one output) run by ONNX Runtime as saved.
#[cfg(test)]
pub(crate) mod test_support {
    use super::model::OnnxModel;
    use crate::ort::session::{OpThreads, OrtModel};

    /// The output of `before` and of `after` on one fixed image.
    pub fn outputs_before_and_after(before: &OnnxModel, after: &OnnxModel) -> (Vec<f32>, Vec<f32>) {
        let dir = tempfile::tempdir().expect("tempdir");
        let x: Vec<f32> = (0..3 * 64 * 64)
            .map(|i| ((i * 37 % 101) as f32) / 100.0)
            .collect();
        let run = |m: &OnnxModel, file: &str| {
            let path = dir.path().join(file);
            m.save(&path).expect("save");
            let mut session = OrtModel::load_uncached(
                &path,
                OpThreads::Own {
                    threads: 1,
                    alone: true,
                },
            )
            .expect("ONNX Runtime loads the model");
            session
                .run(&[("image", [1, 3, 64, 64], &x)], &m.output_names()[0])
                .expect("run")
                .data
        };
        (run(before, "before.onnx"), run(after, "after.onnx"))
    }
}

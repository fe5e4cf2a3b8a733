//! `celer inspect`: what a model directory's pipeline runs, or what an ONNX model takes
//! and returns.

use std::path::PathBuf;

use clap::Args;

use crate::backend::ort::OrtModel;
use crate::config::PIPELINE_FILE;

#[derive(Debug, Clone, Args)]
pub struct InspectArgs {
    /// A model directory (with celer.toml) or an .onnx file.
    pub path: PathBuf,
}

pub fn inspect(args: InspectArgs) -> anyhow::Result<()> {
    let models = if args.path.is_dir() || args.path.ends_with(PIPELINE_FILE) {
        let dir = if args.path.is_dir() {
            args.path.clone()
        } else {
            args.path.parent().map(PathBuf::from).unwrap_or_default()
        };
        let spec = super::load_pipeline(&dir)?;
        println!("pipeline {}", spec.source.display());
        println!("  segmentation: {:?}", spec.segmentation);
        println!("  trimap:       {:?}", spec.trimap);
        println!("  matting:      {:?}", spec.matting);
        println!("  output:       {:?}", spec.default_output);
        spec.model_keys()
            .into_iter()
            .map(|(_, p)| p.to_path_buf())
            .collect()
    } else {
        vec![args.path.clone()]
    };
    for path in models {
        let model = OrtModel::load(&path, 1)?;
        println!("model {}", path.display());
        for (kind, list) in [("input ", model.inputs()), ("output", model.outputs())] {
            for t in list {
                println!(
                    "  {kind} {:<12} {:<8} {:?}",
                    t.name, t.element_type, t.shape
                );
            }
        }
    }
    Ok(())
}

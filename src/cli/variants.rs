//! `celer build --precision fp16|int8`: the reduced-precision variants of the pipeline's
//! models, made before any engine (a GPU's engine is built from the variant). Each is
//! held to the quality gate on the validation images and written with its manifest only
//! if it passes; a variant below the gate fails the build with its table.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;

use crate::quantize::gate::Gate;
use crate::quantize::int8::{build_int8, Int8Options};
use crate::quantize::ranges::Method;
use crate::spec::{ModelPrecision, PipelineSpec};

#[derive(Debug, Clone, Args)]
pub struct VariantArgs {
    /// The models' precision: fp32 (the ONNX files as they are), fp16 (converted) or int8
    /// (calibrated on --calibration). Default: each stage's `precision` in celer.toml,
    /// else fp32.
    #[arg(long)]
    pub precision: Option<ModelPrecision>,

    /// INT8: a folder of images like those the endpoint will see; the activations'
    /// ranges are measured on them.
    #[arg(long, value_name = "DIR")]
    pub calibration: Option<PathBuf>,

    /// A folder of other images (never the calibration ones) on which the variant's
    /// alpha is compared with FP32's: the quality gate.
    #[arg(long, value_name = "DIR")]
    pub validation: Option<PathBuf>,

    /// INT8: how an activation's range is chosen from what calibration saw: minmax,
    /// percentile (the rarest 0.01 % clipped) or entropy (TensorRT's KL divergence).
    #[arg(long, default_value_t = Method::Percentile)]
    pub calibration_method: Method,

    /// The gate: least IoU of alpha > 127 against FP32's, per image and overall.
    #[arg(long, default_value_t = Gate::default().min_iou)]
    pub gate_min_iou: f64,

    /// The gate: largest mean |alpha difference| from FP32's, in 1/255 steps.
    #[arg(long, default_value_t = Gate::default().max_mean_abs_diff)]
    pub gate_max_mean_diff: f64,

    /// INT8: quantize every convolution, without searching for the ones to keep in FP32
    /// when the fully quantized model is below the gate.
    #[arg(long)]
    pub no_search: bool,

    /// ONNX Runtime threads for calibration and the gate (default: this process's cores).
    #[arg(long)]
    pub build_threads: Option<usize>,
}

/// Makes the variant each model stage asks for. Returns whether any was made.
pub fn build_variants(
    spec: &PipelineSpec,
    model_dir: &Path,
    engines_dir: &Path,
    args: &VariantArgs,
) -> anyhow::Result<bool> {
    let precision = args.precision.unwrap_or(spec.segmentation.image.precision);
    match precision {
        ModelPrecision::Fp32 => Ok(false),
        ModelPrecision::Fp16 => anyhow::bail!("fp16 variants are not built yet"),
        ModelPrecision::Int8 => {
            let need = |dir: &Option<PathBuf>, flag: &str| {
                dir.clone().with_context(|| {
                    format!("--precision int8 needs {flag} DIR (a folder of images)")
                })
            };
            let options = Int8Options {
                calibration: need(&args.calibration, "--calibration")?,
                validation: need(&args.validation, "--validation")?,
                method: args.calibration_method,
                gate: Gate {
                    min_iou: args.gate_min_iou,
                    max_mean_abs_diff: args.gate_max_mean_diff,
                },
                threads: args
                    .build_threads
                    .unwrap_or_else(|| crate::host::cpus::CpuBudget::get().cores),
                search: !args.no_search,
                sensitivity_images: 6,
            };
            let built = build_int8(spec, model_dir, engines_dir, &options, &mut |line| {
                println!("{line}")
            })?;
            println!(
                "segmentation model int8: {} ({} convolutions int8, {} kept in FP32)",
                built.dir.display(),
                built.manifest.quantized_nodes,
                built.manifest.kept_fp32.len()
            );
            Ok(true)
        }
    }
}

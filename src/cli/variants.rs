//! `celer build --precision fp16|int8`: the reduced-precision variants of the pipeline's
//! models, made before any engine (a GPU's engine is built from the FP16 variant). Each is
//! held to the quality gate on the validation images and written with its manifest only
//! if it passes; a variant below the gate fails the build with its table. A variant that
//! is still current (made from today's model file, passed) is kept unless `--force`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;

use crate::quantize::fp16::{build_fp16, Fp16Options};
use crate::quantize::gate::Gate;
use crate::quantize::int8::{build_int8, Int8Options};
use crate::quantize::judge::Stage;
use crate::quantize::ranges::Method;
use crate::quantize::variant::current;
use crate::spec::{ModelPrecision, PipelineSpec};

#[derive(Debug, Clone, Args)]
pub struct VariantArgs {
    /// The models' precision: fp32 (the ONNX files as they are), fp16 (converted; what a
    /// GPU's engine is built from) or int8 (calibrated on --calibration; what the CPU
    /// serves). Default: each model stage's `precision` in celer.toml, else fp32.
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

impl VariantArgs {
    fn gate(&self) -> Gate {
        Gate {
            min_iou: self.gate_min_iou,
            max_mean_abs_diff: self.gate_max_mean_diff,
        }
    }

    fn validation(&self, precision: ModelPrecision) -> anyhow::Result<PathBuf> {
        self.validation.clone().with_context(|| {
            format!("--precision {precision} needs --validation DIR: images for the quality gate")
        })
    }
}

/// Makes the variant each model stage asks for (`force`: even where a current one is
/// there).
pub fn build_variants(
    spec: &PipelineSpec,
    model_dir: &Path,
    engines_dir: &Path,
    args: &VariantArgs,
    force: bool,
) -> anyhow::Result<()> {
    for stage in [Stage::Segmentation, Stage::Matting] {
        let Some(image) = stage.image(spec) else {
            continue;
        };
        let mut precision = args.precision.unwrap_or(image.precision);
        if stage == Stage::Matting && precision == ModelPrecision::Int8 {
            println!(
                "matting model: int8 needs calibration inputs of the matting model (image and \
                 trimap), which celer does not make; it stays fp32 (fp16 is available)"
            );
            precision = ModelPrecision::Fp32;
        }
        if precision == ModelPrecision::Fp32 {
            continue;
        }
        if !force {
            if let Some(m) = current(engines_dir, &image.model, precision) {
                println!(
                    "{} model {precision}: current ({} made from this {}, passed its gate); kept \
                     (--force makes it again)",
                    stage.name(),
                    m.variant_file,
                    m.source_file
                );
                continue;
            }
        }
        let threads = args
            .build_threads
            .unwrap_or_else(|| crate::host::cpus::CpuBudget::get().cores);
        let mut say = |line: String| println!("{line}");
        match precision {
            ModelPrecision::Fp32 => {}
            ModelPrecision::Fp16 => {
                let options = Fp16Options {
                    validation: args.validation(precision)?,
                    gate: args.gate(),
                    threads,
                };
                let (dir, _) = build_fp16(spec, stage, model_dir, engines_dir, &options, &mut say)?;
                println!("{} model fp16: {}", stage.name(), dir.display());
            }
            ModelPrecision::Int8 => {
                let options = Int8Options {
                    calibration: args.calibration.clone().context(
                        "--precision int8 needs --calibration DIR: images to measure the \
                         activations' ranges on",
                    )?,
                    validation: args.validation(precision)?,
                    method: args.calibration_method,
                    gate: args.gate(),
                    threads,
                    search: !args.no_search,
                    sensitivity_images: 6,
                };
                let built = build_int8(spec, model_dir, engines_dir, &options, &mut say)?;
                println!(
                    "{} model int8: {} ({} convolutions int8, {} kept in FP32)",
                    stage.name(),
                    built.dir.display(),
                    built.manifest.quantized_nodes,
                    built.manifest.kept_fp32.len()
                );
            }
        }
    }
    Ok(())
}

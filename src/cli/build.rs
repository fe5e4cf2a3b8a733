//! `celer build`: a TensorRT engine for each model of the pipeline on each distinct GPU
//! model of this machine, with a manifest each and a timing cache per GPU model reused
//! by later builds. On a machine without a GPU it validates the models with ONNX Runtime
//! instead (their I/O, the profile a GPU build would use, the fit with celer.toml), says
//! that no engine was built, and succeeds: the CPU path needs no artifacts.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::backend::ort::OrtModel;
use crate::config::PipelineSpec;
use crate::pipeline::Pipeline;
use crate::tensorrt::manifest::{
    engine_dir, model_name, sha256_bytes, sha256_file, write_atomically, BuildRecord,
    EngineManifest, ENGINES_DIR, MANIFEST_FILE, MANIFEST_FORMAT,
};
use crate::tensorrt::probe::{self, GpuInventory};
use crate::tensorrt::profile::{
    resolve_profile, shape_hints, shape_string, BatchRange, NamedShape, ShapeHint, ShapeRequest,
};
use crate::tensorrt::{
    BuildProgress, BuildSettings, BuiltEngine, InputProfile, Precision, TensorDesc, TensorRt,
};

#[derive(Debug, Clone, Args)]
pub struct BuildArgs {
    /// Model directory holding celer.toml and the ONNX files; engines go to its
    /// engines/ folder.
    #[arg(long, env = "CELER_MODEL_DIR", default_value = "/opt/ml/model")]
    pub model_dir: PathBuf,

    /// fp32, fp16 or bf16 (TensorRT 10; default fp32). TensorRT 11 builds strongly typed
    /// networks whose precision comes from the ONNX model, and refuses this option.
    #[arg(long)]
    pub precision: Option<Precision>,

    /// Builder workspace limit, MiB (default: TensorRT's, up to the GPU's memory).
    #[arg(long)]
    pub workspace_mib: Option<u64>,

    /// Batch sizes for inputs with a dynamic batch dimension: N, MIN:MAX or MIN:OPT:MAX
    /// (default 1: one image per request).
    #[arg(long, value_name = "N|MIN:MAX|MIN:OPT:MAX")]
    pub batch: Option<BatchRange>,

    /// Smallest shape of an input, NAME:DxDx... (repeatable; with --opt and --max).
    #[arg(long = "min", value_name = "NAME:SHAPE")]
    pub min_shapes: Vec<NamedShape>,

    /// Shape an input is optimised for, NAME:DxDx... (repeatable).
    #[arg(long = "opt", value_name = "NAME:SHAPE")]
    pub opt_shapes: Vec<NamedShape>,

    /// Largest shape of an input, NAME:DxDx... (repeatable).
    #[arg(long = "max", value_name = "NAME:SHAPE")]
    pub max_shapes: Vec<NamedShape>,

    /// Where to write engines (default: <model dir>/engines).
    #[arg(long)]
    pub engines_dir: Option<PathBuf>,
}

/// One ONNX model of the pipeline.
struct ModelFile {
    key: &'static str,
    path: PathBuf,
    name: String,
    sha256: String,
    hints: Vec<ShapeHint>,
}

pub fn build(args: BuildArgs) -> anyhow::Result<()> {
    let spec = super::load_pipeline(&args.model_dir)?;
    let request = ShapeRequest {
        batch: args.batch,
        min: args.min_shapes.clone(),
        opt: args.opt_shapes.clone(),
        max: args.max_shapes.clone(),
    };
    let models = spec
        .model_keys()
        .into_iter()
        .map(|(key, path)| {
            Ok(ModelFile {
                key,
                path: path.to_path_buf(),
                name: model_name(path),
                sha256: sha256_file(path)
                    .with_context(|| format!("cannot read {}", path.display()))?,
                hints: shape_hints(&spec, path),
            })
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    println!("pipeline {}", spec.source.display());
    let inventory = probe::probe();
    if inventory.devices.is_empty() {
        let reason = inventory.absent.as_deref().unwrap_or("none reported");
        return validate_on_cpu(&spec, &models, &request, reason);
    }
    build_on_gpus(&args, &models, &request, &inventory)
}

/// The CPU-only path: what ONNX Runtime says of each model, and whether they fit the
/// pipeline description.
fn validate_on_cpu(
    spec: &PipelineSpec,
    models: &[ModelFile],
    request: &ShapeRequest,
    reason: &str,
) -> anyhow::Result<()> {
    for m in models {
        print_model_header(m);
        let model = OrtModel::load(&m.path, 1)?;
        let describe = |list: Vec<crate::backend::ort::TensorDescription>, is_input: bool| {
            list.into_iter()
                .map(|t| (t.name, t.element_type, t.shape, is_input))
                .collect::<Vec<_>>()
        };
        let inputs = describe(model.inputs(), true);
        for (name, element_type, shape, is_input) in
            inputs.iter().chain(&describe(model.outputs(), false))
        {
            print_tensor(name, element_type, shape, *is_input);
        }
        let shapes: Vec<(&str, &[i64])> = inputs
            .iter()
            .map(|(n, _, s, _)| (n.as_str(), s.as_slice()))
            .collect();
        let profile = resolve_profile(&shapes, &m.hints, request)
            .with_context(|| format!("optimisation profile for {}", m.path.display()))?;
        print_profile(&profile);
    }
    Pipeline::load(spec, 1)
        .with_context(|| format!("the models do not fit {}", spec.source.display()))?;
    println!(
        "ONNX Runtime: every model loads and fits {}",
        spec.source.display()
    );
    println!(
        "no NVIDIA GPU found ({reason}): no TensorRT engines built. This machine serves the \
         pipeline with ONNX Runtime on the CPU; run `celer build` on the GPU instance type you \
         deploy to, with a celer built with `--features tensorrt`."
    );
    Ok(())
}

fn build_on_gpus(
    args: &BuildArgs,
    models: &[ModelFile],
    request: &ShapeRequest,
    inventory: &GpuInventory,
) -> anyhow::Result<()> {
    let groups = inventory.distinct();
    let found = groups
        .iter()
        .map(|(gpu, ordinals)| {
            format!(
                "{} x {} (compute capability {})",
                ordinals.len(),
                gpu.name,
                gpu.compute_capability
            )
        })
        .collect::<Vec<_>>()
        .join(", ");
    println!(
        "GPUs: {found}; CUDA driver {}",
        inventory.driver_cuda_version.as_deref().unwrap_or("?")
    );
    let trt = TensorRt::load_builder()
        .with_context(|| format!("GPUs found ({found}), but TensorRT cannot build engines"))?;
    let version = trt.version();
    println!("TensorRT {version} ({})", trt.library_file().display());
    let precision = choose_precision(version.major, args.precision)?;
    let engines = args
        .engines_dir
        .clone()
        .unwrap_or_else(|| args.model_dir.join(ENGINES_DIR));
    let cache_dir = engines.join("timing-cache");
    let mut built_count = 0;
    for (gpu, ordinals) in &groups {
        println!(
            "building for {} (compute capability {}) on device {} (engines serve devices {ordinals:?})",
            gpu.name, gpu.compute_capability, ordinals[0]
        );
        let _current = probe::bind_device(ordinals[0]).map_err(anyhow::Error::msg)?;
        // Timing caches are per GPU model and TensorRT version; another one would be
        // refused (and replaced) by the builder anyway.
        let cache_name = format!("{}-trt{version}.cache", gpu.key());
        let cache_path = cache_dir.join(&cache_name);
        let mut cache = std::fs::read(&cache_path).ok();
        if cache.is_some() {
            println!("  timing cache {} (reused)", cache_path.display());
        }
        for m in models {
            print_model_header(m);
            let started = Instant::now();
            let workspace_bytes = args.workspace_mib.map(|mib| mib.saturating_mul(1 << 20));
            let (network_io, profile, built) =
                build_model(&trt, m, request, precision, workspace_bytes, cache.clone())
                    .with_context(|| format!("building {} for {}", m.path.display(), gpu.name))?;
            let (inputs, outputs): (Vec<_>, Vec<_>) =
                network_io.into_iter().partition(|t| t.is_input);
            let elapsed = started.elapsed();

            let dir = engine_dir(&engines, &m.name, gpu);
            let plan_file = format!("{}.plan", m.name);
            write_atomically(&dir.join(&plan_file), &built.plan)
                .with_context(|| format!("cannot write {}", dir.join(&plan_file).display()))?;
            if let Some(bytes) = built.timing_cache {
                write_atomically(&cache_path, &bytes)
                    .with_context(|| format!("cannot write {}", cache_path.display()))?;
                cache = Some(bytes);
            }
            let manifest = EngineManifest {
                format: MANIFEST_FORMAT,
                model: m.name.clone(),
                onnx_file: m
                    .path
                    .strip_prefix(&args.model_dir)
                    .unwrap_or(&m.path)
                    .display()
                    .to_string(),
                onnx_sha256: m.sha256.clone(),
                plan_file: plan_file.clone(),
                plan_sha256: sha256_bytes(&built.plan),
                plan_bytes: built.plan.len() as u64,
                tensorrt_version: version,
                cuda_driver_version: inventory.driver_cuda_version.clone(),
                gpu: gpu.clone(),
                precision,
                profile,
                inputs,
                outputs,
                build: BuildRecord {
                    celer_version: env!("CARGO_PKG_VERSION").into(),
                    built_at_unix_s: SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs()),
                    build_seconds: elapsed.as_secs_f64(),
                    workspace_mib: args.workspace_mib,
                    timing_cache: Some(format!("timing-cache/{cache_name}")),
                    tensorrt_library: trt.library_file().display().to_string(),
                },
            };
            let manifest_path = dir.join(MANIFEST_FILE);
            manifest
                .write(&manifest_path)
                .with_context(|| format!("cannot write {}", manifest_path.display()))?;
            println!(
                "  wrote {} ({:.1} MiB, {precision}) in {}",
                dir.join(&plan_file).display(),
                built.plan.len() as f64 / (1 << 20) as f64,
                seconds(elapsed)
            );
            built_count += 1;
        }
    }
    println!("{built_count} engine(s) built under {}", engines.display());
    Ok(())
}

/// Parses and builds one model; the network (and its builder's memory) is freed on
/// return, before the next model is parsed.
fn build_model(
    trt: &TensorRt,
    m: &ModelFile,
    request: &ShapeRequest,
    precision: Precision,
    workspace_bytes: Option<u64>,
    timing_cache: Option<Vec<u8>>,
) -> anyhow::Result<(Vec<TensorDesc>, Vec<InputProfile>, BuiltEngine)> {
    let mut network = trt.parse_onnx(&m.path)?;
    let mut io = network.inputs()?;
    io.extend(network.outputs()?);
    for t in &io {
        print_tensor(&t.name, &t.data_type.to_string(), &t.shape, t.is_input);
    }
    let shapes: Vec<(&str, &[i64])> = io
        .iter()
        .filter(|t| t.is_input)
        .map(|t| (t.name.as_str(), t.shape.as_slice()))
        .collect();
    let profile = resolve_profile(&shapes, &m.hints, request).context("optimisation profile")?;
    print_profile(&profile);
    let settings = BuildSettings {
        precision,
        workspace_bytes,
        profile: profile.clone(),
        timing_cache,
    };
    let reporter = BuildReporter::new();
    let built = network.build(&settings, &|event| reporter.report(event));
    reporter.finish();
    Ok((io, profile, built?))
}

/// TensorRT 10 takes the precision as builder flags; 11 builds strongly typed networks
/// and has no such flags, so a requested precision there is an error, not a silent no-op.
fn choose_precision(major: u32, requested: Option<Precision>) -> anyhow::Result<Precision> {
    match (major >= 11, requested) {
        (true, None) => {
            println!(
                "precision: from the model (TensorRT {major} builds strongly typed networks: each \
                 layer runs in the type the ONNX model gives it)"
            );
            Ok(Precision::FromModel)
        }
        (true, Some(p)) => anyhow::bail!(
            "--precision {p}: TensorRT {major} builds strongly typed networks, so the precision \
             comes from the ONNX model's types and cannot be chosen at build time. Export the \
             model in the precision you want (e.g. float16 with onnxconverter-common) and build \
             without --precision"
        ),
        (false, None) => {
            println!("precision: fp32 (default; --precision fp16 is usually much faster)");
            Ok(Precision::Fp32)
        }
        (false, Some(Precision::FromModel)) => {
            anyhow::bail!("TensorRT {major} needs a precision: fp32, fp16 or bf16")
        }
        (false, Some(p)) => {
            println!("precision: {p}");
            Ok(p)
        }
    }
}

fn print_model_header(m: &ModelFile) {
    println!(
        "model {} {} (sha256 {})",
        m.key,
        m.path.display(),
        m.sha256.get(..12).unwrap_or(&m.sha256)
    );
}

fn print_tensor(name: &str, element_type: &str, shape: &[i64], is_input: bool) {
    let kind = if is_input { "input " } else { "output" };
    println!(
        "  {kind} {name:<12} {element_type:<8} {}",
        shape_string(shape)
    );
}

fn print_profile(profile: &[InputProfile]) {
    if profile.is_empty() {
        println!("  profile: static shapes, no optimisation profile needed");
    }
    super::inspect::print_profiles(profile);
}

fn seconds(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

/// Shows TensorRT's build phases: top-level phases as lines, the innermost step count on
/// a spinner (hidden when stderr is not a terminal).
struct BuildReporter {
    bar: ProgressBar,
    steps: Mutex<HashMap<String, i32>>,
}

impl BuildReporter {
    fn new() -> Self {
        let bar = ProgressBar::new_spinner().with_style(
            ProgressStyle::with_template("  {spinner} {elapsed} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.enable_steady_tick(Duration::from_millis(200));
        Self {
            bar,
            steps: Mutex::new(HashMap::new()),
        }
    }

    fn report(&self, event: BuildProgress<'_>) {
        let mut steps = self.steps.lock().unwrap_or_else(|p| p.into_inner());
        match event {
            BuildProgress::PhaseStart {
                phase,
                parent,
                steps: n,
            } => {
                steps.insert(phase.to_string(), n);
                if parent.is_none() {
                    self.bar.suspend(|| eprintln!("  phase: {phase}"));
                }
                self.bar.set_message(phase.to_string());
            }
            BuildProgress::Step { phase, step } => {
                let n = steps.get(phase).copied().unwrap_or(0);
                self.bar.set_message(format!("{phase} {}/{n}", step + 1));
            }
            BuildProgress::PhaseFinish { phase } => {
                steps.remove(phase);
            }
        }
    }

    fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precision_follows_the_tensorrt_major() {
        assert_eq!(choose_precision(10, None).unwrap(), Precision::Fp32);
        assert_eq!(
            choose_precision(10, Some(Precision::Fp16)).unwrap(),
            Precision::Fp16
        );
        assert_eq!(choose_precision(11, None).unwrap(), Precision::FromModel);
        let msg = choose_precision(11, Some(Precision::Fp16))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("strongly typed"), "{msg}");
        assert!(msg.contains("--precision fp16"), "{msg}");
    }
}

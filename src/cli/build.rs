//! `celer build`: a TensorRT engine for each model of the pipeline on each distinct GPU
//! model of this machine, with a manifest each and a timing cache per GPU model reused
//! by later builds; an engine that is still current (its manifest fits the GPU model, the
//! TensorRT version, the ONNX file, the precision and the profile) is kept unless
//! `--force`. Building and storing is `engines::store`'s (shared with `serve`);
//! this module picks the GPUs and prints what the store reports. On a machine without a
//! GPU it validates the models with ONNX Runtime instead (their I/O, the profile a GPU
//! build would use, the fit with celer.toml), says that no engine was built, and
//! succeeds: the CPU path needs no artifacts.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use super::inspect::print_tensor;
use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::cuda::Probe;
use crate::engines::manifest::GpuIdentity;
use crate::engines::profile::{resolve_profile, BatchRange, NamedShape, ShapeRequest};
use crate::engines::store::{
    build_and_store, choose_precision, BuildEvent, BuildOptions, EngineStore, ModelFile,
    StoredEngine,
};
use crate::ort::session::OrtModel;
use crate::quantize::variant::{choose, Target};
use crate::replica::cpu::CpuStages;

use crate::spec::{ModelPrecision, PipelineSpec};
use crate::tensorrt::{BuildProgress, InputProfile, Precision, TensorRt};

#[derive(Debug, Clone, Args)]
pub struct BuildArgs {
    /// Model directory holding celer.toml and the ONNX files; engines go to its
    /// engines/ folder.
    #[arg(long, env = "CELER_MODEL_DIR", default_value = "/opt/ml/model")]
    pub model_dir: PathBuf,

    #[command(flatten)]
    pub variants: super::variants::VariantArgs,

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

    /// Rebuild every engine, current ones too (by default an engine whose manifest still
    /// fits the GPU, the TensorRT version, the ONNX file, the precision and the profile
    /// is kept).
    #[arg(long)]
    pub force: bool,
}

pub fn build(args: BuildArgs) -> anyhow::Result<()> {
    let spec = super::load_pipeline(&args.model_dir)?;
    let request = ShapeRequest {
        batch: args.batch,
        min: args.min_shapes.clone(),
        opt: args.opt_shapes.clone(),
        max: args.max_shapes.clone(),
    };
    println!("pipeline {}", spec.source.display());
    let store = EngineStore::new(&args.model_dir, args.engines_dir.clone());
    super::variants::build_variants(
        &spec,
        &args.model_dir,
        &store.engines,
        &args.variants,
        args.force,
    )?;
    let probe = crate::cuda::probe();
    if probe.gpus().is_empty() {
        let models = ModelFile::of_pipeline(&spec)?;
        return validate_on_cpu(&spec, &models, &request, &probe.summary());
    }
    // A GPU's engines are built from the FP16 variants where they passed their gate.
    let (gpu_spec, choices) = choose(&spec, &store.engines, Target::Gpu, false);
    for choice in &choices {
        println!("{}", choice.describe());
    }
    let fp16 = choices.iter().any(|c| c.precision == ModelPrecision::Fp16);
    let models = ModelFile::of_pipeline(&gpu_spec)?;
    build_on_gpus(&args, &store, &models, &request, &probe, fp16)
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
        let describe = |list: Vec<crate::ort::session::TensorDescription>, is_input: bool| {
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
    CpuStages::load(spec, 1)
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
    store: &EngineStore,
    models: &[ModelFile],
    request: &ShapeRequest,
    probe: &Probe,
    fp16: bool,
) -> anyhow::Result<()> {
    let groups = probe.distinct();
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
        probe.driver_cuda_version().as_deref().unwrap_or("?")
    );
    let trt = TensorRt::load_builder()
        .with_context(|| format!("GPUs found ({found}), but TensorRT cannot build engines"))?;
    let version = trt.version();
    println!("TensorRT {version} ({})", trt.library_file().display());
    // TensorRT 11 takes each layer's type from the (FP16 or FP32) ONNX model; 10 builds
    // an FP16 model's layers in FP16 only with its builder flag.
    let flag = (fp16 && version.major < 11).then_some(Precision::Fp16);
    let (precision, why) = choose_precision(version.major, flag)?;
    println!("precision: {why}");
    let options = BuildOptions {
        precision,
        workspace_mib: args.workspace_mib,
        request: request.clone(),
    };
    let (mut built_count, mut reused_count) = (0, 0);
    for (gpu, ordinals) in &groups {
        println!(
            "building for {} (compute capability {}) on device {} (engines serve devices {ordinals:?})",
            gpu.name, gpu.compute_capability, ordinals[0]
        );
        let _current = crate::cuda::device::bind(ordinals[0] as usize)?;
        // Said once per GPU, as before its first model; each build reads the cache anew
        // (the previous build updated it), so the store's per-model event is not printed.
        let cache_path = store.timing_cache_path(gpu, version);
        if cache_path.is_file() {
            println!("  timing cache {} (reused)", cache_path.display());
        }
        for m in models {
            print_model_header(m);
            match current_engine(store, m, gpu, version, &options, args.force) {
                Currency::Current(plan) => {
                    println!(
                        "  current: {} fits this GPU, TensorRT {version}, the ONNX file and \
                         {precision}; kept (--force rebuilds it)",
                        plan.display()
                    );
                    reused_count += 1;
                    continue;
                }
                Currency::Stale(why) => println!("  rebuilding: {why}"),
                Currency::Missing => {}
            }
            let stored =
                build_printing(&trt, store, m, gpu, probe.driver_cuda_version(), &options)?;
            println!(
                "  wrote {} ({:.1} MiB, {precision}) in {}",
                stored.engine.plan.display(),
                stored.engine.manifest.plan_bytes as f64 / (1 << 20) as f64,
                seconds(stored.build_time)
            );
            built_count += 1;
        }
    }
    println!(
        "{built_count} engine(s) built, {reused_count} current engine(s) kept, under {}",
        store.engines.display()
    );
    Ok(())
}

/// Whether a stored engine may be kept instead of rebuilt.
enum Currency {
    /// It fits: this plan.
    Current(PathBuf),
    /// There is one, but it no longer fits, for this reason.
    Stale(String),
    /// There is none (or `--force` asked for a new one).
    Missing,
}

/// Whether `m`'s stored engine for `gpu` is current: its manifest fits the GPU model, the
/// TensorRT version and the ONNX file's bytes (the checks `serve` makes), and it was built
/// with the precision and the optimisation profile this build would use.
fn current_engine(
    store: &EngineStore,
    m: &ModelFile,
    gpu: &GpuIdentity,
    version: crate::tensorrt::TrtVersion,
    options: &BuildOptions,
    force: bool,
) -> Currency {
    use crate::engines::manifest::EngineCheckError;
    if force {
        return Currency::Missing;
    }
    let checked = match store.find(m, gpu, version) {
        Ok(checked) => checked,
        Err(EngineCheckError::Mismatch { reasons, .. }) => {
            return Currency::Stale(reasons.join("; "))
        }
        Err(EngineCheckError::Missing { .. }) => return Currency::Missing,
        Err(e) => return Currency::Stale(e.to_string()),
    };
    let manifest = &checked.manifest;
    if manifest.precision != options.precision {
        return Currency::Stale(format!(
            "built for {}, this build is {}",
            manifest.precision, options.precision
        ));
    }
    let shapes: Vec<(&str, &[i64])> = manifest
        .inputs
        .iter()
        .map(|t| (t.name.as_str(), t.shape.as_slice()))
        .collect();
    match resolve_profile(&shapes, &m.hints, &options.request) {
        Ok(profile) if profile == manifest.profile => Currency::Current(checked.plan),
        Ok(_) => Currency::Stale("built with another optimisation profile".into()),
        Err(e) => Currency::Stale(format!("its inputs do not take this profile: {e}")),
    }
}

/// One model through the engine store, printing its tensors and profile and showing the
/// build's phases on a spinner (started with the build, cleared when it ends).
fn build_printing(
    trt: &TensorRt,
    store: &EngineStore,
    m: &ModelFile,
    gpu: &GpuIdentity,
    driver_cuda_version: Option<String>,
    options: &BuildOptions,
) -> anyhow::Result<StoredEngine> {
    let reporter = OnceLock::new();
    let print = |event: BuildEvent<'_>| match event {
        BuildEvent::Tensor(t) => {
            print_tensor(&t.name, &t.data_type.to_string(), &t.shape, t.is_input)
        }
        BuildEvent::Profile(profile) => {
            print_profile(profile);
            reporter.get_or_init(BuildReporter::new);
        }
        BuildEvent::Progress(event) => reporter.get_or_init(BuildReporter::new).report(event),
        BuildEvent::TimingCacheReused(_) => {}
    };
    let stored = build_and_store(trt, store, m, gpu, driver_cuda_version, options, &print);
    if let Some(reporter) = reporter.get() {
        reporter.finish();
    }
    Ok(stored?)
}

fn print_model_header(m: &ModelFile) {
    println!(
        "model {} {} (sha256 {})",
        m.key,
        m.path.display(),
        crate::engines::manifest::short(&m.sha256)
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

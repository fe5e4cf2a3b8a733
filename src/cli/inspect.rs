//! `celer inspect`: what a model directory's pipeline runs (and which engines it has),
//! what an ONNX model takes and returns, or what an engine was built for (its manifest,
//! and its I/O as TensorRT reports it where TensorRT and that GPU are available).

use std::path::{Path, PathBuf};

use anyhow::Context;
use clap::Args;

use crate::engines::manifest::model_name;
use crate::engines::manifest::{list_manifests, short, EngineManifest, ENGINES_DIR, MANIFEST_FILE};
use crate::engines::profile::shape_string;
use crate::ort::session::OrtModel;
use crate::quantize::variant::{choose, variant_dir, Target, VariantManifest};
use crate::spec::{ModelPrecision, PipelineSpec, PIPELINE_FILE};
use crate::tensorrt::{InputProfile, TensorDesc, TensorRt};

#[derive(Debug, Clone, Args)]
pub struct InspectArgs {
    /// A model directory (with celer.toml), an .onnx file, or an engine (its .plan, its
    /// manifest.json, or its folder).
    pub path: PathBuf,
}

pub fn inspect(args: InspectArgs) -> anyhow::Result<()> {
    if let Some(dir) = engine_folder(&args.path) {
        return inspect_engine(&dir);
    }
    let mut engines = None;
    let mut pipeline = None;
    let models = if args.path.is_dir() || args.path.ends_with(PIPELINE_FILE) {
        let dir = if args.path.is_dir() {
            args.path.clone()
        } else {
            args.path.parent().map(PathBuf::from).unwrap_or_default()
        };
        let spec = super::load_pipeline(&dir)?;
        engines = Some(dir.join(ENGINES_DIR));
        println!("{spec}");
        let models = spec
            .model_keys()
            .into_iter()
            .map(|(_, p)| p.to_path_buf())
            .collect();
        pipeline = Some(spec);
        models
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
    if let (Some(engines), Some(spec)) = (&engines, &pipeline) {
        print_precisions(spec, engines);
    }
    if let Some(engines) = engines {
        let found = list_manifests(&engines);
        if found.is_empty() {
            println!(
                "engines: none in {} (`celer build` makes them)",
                engines.display()
            );
        }
        for path in found {
            match EngineManifest::read(&path) {
                Ok(m) => println!(
                    "engine {}: {} for {} (compute capability {}), TensorRT {}, {}",
                    path.parent().unwrap_or(&path).display(),
                    m.model,
                    m.gpu.name,
                    m.gpu.compute_capability,
                    m.tensorrt_version,
                    m.precision
                ),
                Err(e) => println!("engine {}: {e}", path.display()),
            }
        }
    }
    Ok(())
}

/// Which precision each model stage runs in on the CPU and on a GPU, and each variant's
/// record: how it was made and what its gate measured.
fn print_precisions(spec: &PipelineSpec, engines: &Path) {
    for target in [Target::Cpu, Target::Gpu] {
        let (_, choices) = choose(spec, engines, target, false);
        for c in choices {
            println!("precision on {}: {}", target.name(), c.describe());
        }
    }
    for (_, source) in spec.model_keys() {
        for precision in [ModelPrecision::Fp16, ModelPrecision::Int8] {
            let dir = variant_dir(engines, &model_name(source), precision);
            let m = match VariantManifest::read(&dir) {
                Ok(Some(m)) => m,
                Ok(None) => continue,
                Err(e) => {
                    println!("variant {}: {e}", dir.display());
                    continue;
                }
            };
            println!(
                "variant {}: {} of {} (sha256 {}), operator set {} -> {}, by celer {}",
                dir.join(&m.variant_file).display(),
                m.precision,
                m.source_file,
                short(&m.source_sha256),
                m.opset_from,
                m.opset_to,
                m.celer_version
            );
            if let Some(c) = &m.calibration {
                println!(
                    "  calibration  {} ranges on {} images; {} convolutions int8, {} kept in FP32",
                    c.method,
                    c.images.len(),
                    m.quantized_nodes,
                    m.kept_fp32.len()
                );
            }
            for r in m.rewrites.iter().flatten() {
                println!("  rewritten    {r}");
            }
            for k in &m.kept_fp32 {
                println!(
                    "  kept in fp32 {} (alone quantized: mean |output difference| {:.4}; {:.2} % of the cost)",
                    k.node,
                    k.sensitivity,
                    100.0 * k.cost_share
                );
            }
            match &m.gate {
                Some(g) => print!("  gate on the validation images\n{}", g.table()),
                None => println!("  gate: no figures recorded (not served)"),
            }
        }
    }
}

/// The engine folder `path` names: a .plan, a manifest.json, or a folder holding one.
fn engine_folder(path: &Path) -> Option<PathBuf> {
    let is_plan = path.extension().is_some_and(|e| e == "plan");
    let is_manifest = path.file_name().is_some_and(|n| n == MANIFEST_FILE);
    if is_plan || is_manifest {
        return Some(path.parent().map(Path::to_path_buf).unwrap_or_default());
    }
    (path.is_dir() && path.join(MANIFEST_FILE).is_file()).then(|| path.to_path_buf())
}

fn inspect_engine(dir: &Path) -> anyhow::Result<()> {
    let manifest_path = dir.join(MANIFEST_FILE);
    let m = EngineManifest::read(&manifest_path)
        .with_context(|| format!("an engine is inspected through the {MANIFEST_FILE} that `celer build` writes next to it"))?;
    let plan = dir.join(&m.plan_file);
    println!(
        "engine {} ({} bytes, sha256 {})",
        plan.display(),
        m.plan_bytes,
        short(&m.plan_sha256)
    );
    println!(
        "  model        {} ({}, sha256 {})",
        m.model,
        m.onnx_file,
        short(&m.onnx_sha256)
    );
    println!(
        "  gpu          {} (compute capability {})",
        m.gpu.name, m.gpu.compute_capability
    );
    println!("  tensorrt     {}", m.tensorrt_version);
    println!(
        "  cuda driver  {}",
        m.cuda_driver_version.as_deref().unwrap_or("?")
    );
    println!("  precision    {}", m.precision);
    println!(
        "  built        by celer {} in {:.1} s, workspace {}, timing cache {}",
        m.build.celer_version,
        m.build.build_seconds,
        m.build
            .workspace_mib
            .map_or("default".to_string(), |w| format!("{w} MiB")),
        m.build.timing_cache.as_deref().unwrap_or("none")
    );
    print_tensors(&m.inputs, &m.outputs);
    print_profiles(&m.profile);
    match engine_io(&plan, &m) {
        Ok((io, profiles)) => {
            println!("as TensorRT loads it:");
            let (inputs, outputs): (Vec<_>, Vec<_>) = io.into_iter().partition(|t| t.is_input);
            print_tensors(&inputs, &outputs);
            print_profiles(&profiles);
        }
        Err(reason) => println!("engine I/O from TensorRT: not shown ({reason:#})"),
    }
    Ok(())
}

/// Deserialises the plan on a GPU of the kind it was built for, to list its I/O.
fn engine_io(
    plan: &Path,
    m: &EngineManifest,
) -> anyhow::Result<(Vec<TensorDesc>, Vec<InputProfile>)> {
    let trt = TensorRt::load_runtime()?;
    let probe = crate::cuda::probe();
    let device = probe
        .gpus()
        .iter()
        .find(|d| d.identity() == m.gpu)
        .with_context(|| {
            format!(
                "no {} (compute capability {}) on this machine ({})",
                m.gpu.name,
                m.gpu.compute_capability,
                probe.summary()
            )
        })?;
    let current = crate::cuda::device::bind(device.ordinal)?;
    let bytes = std::fs::read(plan).with_context(|| format!("cannot read {}", plan.display()))?;
    let scope = crate::cuda::trt_context::TrtContext::scope(&current);
    let engine = trt.runtime(scope)?.deserialize(&bytes)?;
    let mut profiles = Vec::new();
    for index in 0..engine.profile_count()? {
        for input in engine.inputs() {
            if input.shape.iter().any(|d| *d < 0) {
                profiles.push(engine.profile(&input.name, index)?);
            }
        }
    }
    Ok((engine.io_tensors().to_vec(), profiles))
}

fn print_tensors(inputs: &[TensorDesc], outputs: &[TensorDesc]) {
    for t in inputs.iter().chain(outputs) {
        print_tensor(&t.name, &t.data_type.to_string(), &t.shape, t.is_input);
    }
}

/// One line per tensor: kind, name, element type, shape (shared with `celer build`).
pub(super) fn print_tensor(name: &str, element_type: &str, shape: &[i64], is_input: bool) {
    let kind = if is_input { "input " } else { "output" };
    println!(
        "  {kind} {name:<12} {element_type:<8} {}",
        shape_string(shape)
    );
}

/// One line per input of an optimisation profile (shared with `celer build`).
pub(super) fn print_profiles(profiles: &[InputProfile]) {
    for p in profiles {
        println!(
            "  profile {}: min {} opt {} max {}",
            p.name,
            shape_string(&p.min),
            shape_string(&p.opt),
            shape_string(&p.max)
        );
    }
}

//! The devices `celer serve` and `celer run` start: `--devices` resolved against the CUDA
//! probe; for GPUs, what runs their models (engines, or ONNX Runtime where TensorRT is
//! absent), decided before anything listens, and the page-locked pool their requests'
//! pixels live in; otherwise the CPU, and the heap.

use anyhow::Context;

use crate::config::{Devices, Replicas};
use crate::cuda::{GpuInfo, Probe};
use crate::engines::dirs::EngineDirs;
use crate::engines::plan::{plan_gpus, GpuPlan};
use crate::engines::store::EngineStore;
use crate::pixels::{self, Reserve, SharedAlloc};
use crate::quantize::variant::{choose, Target};
use crate::replica::cpu::cpu_device_setup;
use crate::replica::gpu::{
    gpu_device_setup, host_pool, GpuLimits, GpuServing, DEFAULT_BLOCK_PIXELS,
};
use crate::replica::BoxedMatteExecutor;
use crate::sched::{Device, DeviceSetup};
use crate::spec::{ModelPrecision, PipelineSpec};

/// How many requests of each `--warmup-size` the CPU's pixel heap keeps blocks made for
/// (the image, its alpha and trimap), for each replica: one it runs, one queued next, one
/// decoding or being answered. Mixed
/// 320x320 and 12 MP traffic from 8 clients at a 1.5 s deadline had at most 6 of its 12 MP
/// images in flight at once on 2 replicas (120 s), and each block the heap made past the
/// first seconds came with admitted requests that expired (`pixels::RecyclingHeap`).
const RESERVE_PER_CPU_REPLICA: usize = 3;

/// The devices a server runs, and where its requests' pixels go: a GPU server's decoders
/// write into the page-locked blocks its replicas copy from and into.
pub struct ServingDevices {
    pub setups: Vec<DeviceSetup<BoxedMatteExecutor>>,
    pub pixels: SharedAlloc,
    /// The precision each device runs the segmentation model in (`/metrics` labels the
    /// model stage with it).
    pub precisions: Vec<(Device, ModelPrecision)>,
}

/// `spec` as `target` runs it: each model stage swapped for its usable variant under
/// `engines_dir` (default: the model folder's engines/; none with `--fp32`), the choice
/// logged.
pub fn with_variants(
    spec: &PipelineSpec,
    model_dir: &std::path::Path,
    engines_dir: Option<std::path::PathBuf>,
    fp32: bool,
    target: Target,
) -> (PipelineSpec, ModelPrecision) {
    let engines = EngineStore::new(model_dir, engines_dir).engines;
    let (chosen, choices) = choose(spec, &engines, target, fp32);
    for choice in &choices {
        tracing::info!(
            on = target.name(),
            precision = %choice.precision,
            "{}",
            choice.describe()
        );
    }
    let segmentation = choices
        .first()
        .map_or(ModelPrecision::Fp32, |c| c.precision);
    (chosen, segmentation)
}

/// The device setups for `spec` from the model folder `model_dir`, images up to
/// `max_pixels`. Fails, before any model is loaded, when a named GPU is missing or a
/// stored engine does not fit.
pub fn device_setups(
    spec: &PipelineSpec,
    model_dir: &std::path::Path,
    replicas: &Replicas,
    device: &Devices,
    max_pixels: u64,
) -> anyhow::Result<ServingDevices> {
    let variants = |target| {
        with_variants(
            spec,
            model_dir,
            device.engines_dir.clone(),
            device.fp32,
            target,
        )
    };
    // The probe checks for libcuda before any CUDA call, so this never panics on a
    // machine without a GPU.
    let probe = crate::cuda::probe();
    let found: Vec<u32> = probe.gpus().iter().map(|g| g.ordinal as u32).collect();
    let devices = device
        .selection
        .resolve(&found)
        .map_err(|e| anyhow::anyhow!("{e} [{}]", probe.summary()))?;
    let gpus: Vec<_> = probe
        .gpus()
        .iter()
        .filter(|g| devices.contains(&Device::Gpu(g.ordinal as u32)))
        .cloned()
        .collect();
    if gpus.is_empty() {
        match &probe {
            Probe::NoDriver => {}
            // A driver that does not work, or is older than celer's floor, is worth a look.
            Probe::DriverError { .. } => {
                tracing::warn!(cuda = %probe.summary(), "serving on the CPU")
            }
            Probe::Ready { .. } => tracing::info!(cuda = %probe.summary(), "serving on the CPU"),
        }
        let (count, threads) = replicas.on_cpu();
        let solo_threads = replicas.solo(threads);
        tracing::info!(
            replicas = count,
            threads_per_replica = threads,
            solo_threads,
            "the CPU runs the pipeline with ONNX Runtime"
        );
        let (cpu_spec, precision) = variants(Target::Cpu);
        let reserve = Reserve::for_sizes(&device.warmup_sizes, RESERVE_PER_CPU_REPLICA * count);
        if !reserve.blocks.is_empty() {
            tracing::info!(
                blocks = ?reserve.blocks,
                bytes = reserve.bytes(),
                "pixel blocks made and kept for the warm-up sizes"
            );
        }
        let pixels = pixels::recycling_heap(reserve);
        return Ok(ServingDevices {
            setups: vec![cpu_device_setup(
                &cpu_spec,
                count,
                threads,
                solo_threads,
                &device.warmup_sizes,
                pixels.clone(),
            )],
            pixels,
            precisions: vec![(Device::Cpu, precision)],
        });
    }
    tracing::info!(cuda = %probe.summary(), "GPUs found");
    let (gpu_spec, gpu_precision) = variants(Target::Gpu);
    let plans = gpu_plans(
        &gpu_spec,
        model_dir,
        &gpus,
        &probe,
        device.engines_dir.as_deref(),
        device.build_engines,
    )?;
    let interim = plans.iter().any(|plan| plan.models.builds()).then(|| {
        let (cpu_spec, precision) = variants(Target::Cpu);
        (
            interim_cpu(&cpu_spec, replicas, &device.warmup_sizes),
            precision,
        )
    });
    let (replicas, threads) = replicas.on_gpus(plans.len());
    let limits = GpuLimits {
        max_pixels,
        ..GpuLimits::default()
    };
    let largest_warmup = device
        .warmup_sizes
        .iter()
        .map(|&(w, h)| u64::from(w) * u64::from(h))
        .max()
        .unwrap_or(0);
    let pool = host_pool(
        replicas * plans.len(),
        max_pixels,
        DEFAULT_BLOCK_PIXELS.max(largest_warmup),
    );
    let stats = pool.stats();
    tracing::info!(
        blocks = stats.blocks,
        mib = stats.bytes >> 20,
        "host blocks for requests' pixels, page-locked in each GPU's context as it opens"
    );
    let serving = GpuServing {
        limits,
        pool: pool.clone(),
        warmup: device.warmup_sizes.clone(),
    };
    let mut precisions: Vec<(Device, ModelPrecision)> = plans
        .iter()
        .map(|plan| (Device::Gpu(plan.info.ordinal as u32), gpu_precision))
        .collect();
    let (interim, interim_precision) = interim.unzip();
    precisions.extend(interim_precision.map(|p| (Device::Cpu, p)));
    let setups = plans
        .into_iter()
        .map(|plan| gpu_device_setup(&gpu_spec, plan, replicas, threads, serving.clone()))
        .chain(interim)
        .collect();
    Ok(ServingDevices {
        setups,
        pixels: std::sync::Arc::new(pool),
        precisions,
    })
}

/// The CPU, serving with ONNX Runtime while a GPU's engines build (minutes): requests
/// are answered from the start, move to each GPU as its engines load, and the CPU's
/// replicas unload once every GPU has (`DeviceSetup::interim`).
fn interim_cpu(
    spec: &PipelineSpec,
    replicas: &Replicas,
    warmup: &[(u32, u32)],
) -> DeviceSetup<BoxedMatteExecutor> {
    let (count, threads) = replicas.on_cpu();
    tracing::info!(
        replicas = count,
        threads_per_replica = threads,
        "while the GPUs' engines build, the CPU serves with ONNX Runtime"
    );
    DeviceSetup {
        interim: true,
        // The heap's: the pool's page-locked blocks are the GPUs' (a lease they cannot
        // serve is pinned anew, on a thread of its own).
        ..cpu_device_setup(
            spec,
            count,
            threads,
            replicas.solo(threads),
            warmup,
            pixels::heap(),
        )
    }
}

/// What each of `gpus` serves from: the engines found under `engines_dir` (default: the
/// model folder's `engines/`), built at start-up with `build_engines`, else ONNX Runtime.
/// Fails when a stored engine does not fit.
pub fn gpu_plans(
    spec: &PipelineSpec,
    model_dir: &std::path::Path,
    gpus: &[GpuInfo],
    probe: &Probe,
    engines_dir: Option<&std::path::Path>,
    build_engines: bool,
) -> anyhow::Result<Vec<GpuPlan>> {
    let engines = EngineDirs::resolve(model_dir, engines_dir, build_engines)?;
    if engines.built != engines.shipped {
        tracing::warn!(
            shipped = %engines.shipped.display(),
            built = %engines.built.display(),
            "the model folder's engines/ cannot be written: engines built at start-up go to a \
             temporary folder (lost with the container; --engines-dir names a lasting one)"
        );
    }
    plan_gpus(
        spec,
        model_dir,
        &engines,
        gpus,
        build_engines,
        probe.driver_cuda_version(),
    )
    .context("the engines do not fit this machine")
}

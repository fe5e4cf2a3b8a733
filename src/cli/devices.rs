//! The devices `celer serve` and `celer run` start: `--devices` resolved against the CUDA
//! probe; for GPUs, what runs their models (engines, or ONNX Runtime where TensorRT is
//! absent), decided before anything listens; otherwise the CPU.

use anyhow::Context;

use crate::config::{DeviceArgs, RuntimeArgs};
use crate::cuda::Probe;
use crate::engines::dirs::EngineDirs;
use crate::engines::plan::plan_gpus;
use crate::replica::cpu::cpu_device_setup;
use crate::replica::gpu::{gpu_device_setup, GpuLimits};
use crate::replica::BoxedPipelineExecutor;
use crate::sched::{Device, DeviceSetup};
use crate::spec::PipelineSpec;

/// The device setups for `spec`, images up to `max_pixels`. Fails, before any model is
/// loaded, when a named GPU is missing or a stored engine does not fit.
pub fn device_setups(
    spec: &PipelineSpec,
    runtime: &RuntimeArgs,
    device: &DeviceArgs,
    max_pixels: u64,
) -> anyhow::Result<Vec<DeviceSetup<BoxedPipelineExecutor>>> {
    // The probe checks for libcuda before any CUDA call, so this never panics on a
    // machine without a GPU.
    let probe = crate::cuda::probe();
    let found: Vec<u32> = probe.gpus().iter().map(|g| g.ordinal as u32).collect();
    let devices = device
        .devices
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
        let (replicas, threads) = runtime.replicas_and_threads();
        let solo_threads = runtime.solo_threads(threads);
        tracing::info!(
            replicas,
            threads_per_replica = threads,
            solo_threads,
            "the CPU runs the pipeline with ONNX Runtime"
        );
        return Ok(vec![cpu_device_setup(
            spec,
            replicas,
            threads,
            solo_threads,
        )]);
    }
    tracing::info!(cuda = %probe.summary(), "GPUs found");
    let engines = EngineDirs::resolve(
        &runtime.model_dir,
        device.engines_dir.as_deref(),
        device.build_engines,
    )?;
    if engines.built != engines.shipped {
        tracing::warn!(
            shipped = %engines.shipped.display(),
            built = %engines.built.display(),
            "the model folder's engines/ cannot be written: engines built at start-up go to a \
             temporary folder (lost with the container; --engines-dir names a lasting one)"
        );
    }
    let plans = plan_gpus(
        spec,
        &runtime.model_dir,
        &engines,
        &gpus,
        device.build_engines,
        probe.driver_cuda_version(),
    )
    .context("the engines do not fit this machine")?;
    let (replicas, threads) = runtime.gpu_replicas_and_threads(plans.len());
    let limits = GpuLimits {
        max_pixels,
        ..GpuLimits::default()
    };
    Ok(plans
        .into_iter()
        .map(|plan| gpu_device_setup(spec, plan, replicas, threads, limits))
        .collect())
}

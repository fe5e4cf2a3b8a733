//! In-process benchmarks, no HTTP (what trtexec is to TensorRT): the time of each stage
//! of the pipeline on one image, and the rate at which the backend alone runs the
//! segmentation model on the same replicas and threads (the limit a server can approach).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::codec::decode::{decode, decode_into, DecodeLimits};
use crate::codec::{render, RenderError};
use crate::matte::{MattePlanes, StageTimings};
use crate::ort::session::OpThreads;
use crate::ort::OrtError;
use crate::pixels::HostAlloc;
use crate::replica::cpu::{cpu_cores, timed_cutout, CpuError, CpuStages};
use crate::replica::gpu::GpuStages;
use crate::spec::{OutputKind, PipelineSpec};

#[derive(Debug, thiserror::Error)]
pub enum LocalBenchError {
    #[error(transparent)]
    Backend(#[from] OrtError),
    #[error(transparent)]
    Pipeline(#[from] CpuError),
    #[error(transparent)]
    Render(#[from] RenderError),
    #[error(transparent)]
    Model(#[from] crate::replica::models::ModelError),
    #[error("a session's thread panicked")]
    SessionPanicked,
    #[error("cannot decode the benchmark image: {0}")]
    Decode(#[from] crate::codec::decode::DecodeError),
    #[error(transparent)]
    Gpu(#[from] crate::replica::gpu::GpuError),
    #[error("this thread's CPU time cannot be read (CLOCK_THREAD_CPUTIME_ID)")]
    NoThreadClock,
}

/// Runs decode + pipeline + render on `image_bytes` `warmup + iterations` times on one
/// replica as `celer serve` runs a lone request (its own `threads`, the device's
/// `solo_threads` lent to it); returns the measured iterations' timings.
pub fn stage_timings(
    spec: &PipelineSpec,
    image_bytes: &[u8],
    output: OutputKind,
    (threads, solo_threads): (usize, usize),
    warmup: usize,
    iterations: usize,
) -> Result<Vec<StageTimings>, LocalBenchError> {
    let cores = Arc::new(cpu_cores(spec, threads, solo_threads)?);
    let mut pipeline = CpuStages::on(spec, threads, cores)?;
    let mut measured = Vec::with_capacity(iterations);
    for i in 0..warmup + iterations {
        let t = Instant::now();
        let image = decode(image_bytes, &DecodeLimits::default())?;
        let mut timings = StageTimings {
            decode: t.elapsed(),
            ..StageTimings::default()
        };
        let matte = pipeline.run(&image, &mut timings)?;
        let cutout = output
            .needs_cutout()
            .then(|| timed_cutout(&image, &matte, &mut timings));
        render(
            &MattePlanes::from_matte(matte, cutout),
            output,
            &mut timings,
        )?;
        if i >= warmup {
            measured.push(timings);
        }
    }
    Ok(measured)
}

/// How the model alone is run: `sessions` sessions, each driven back to back by its own
/// thread, their operators on `threads`.
#[derive(Debug, Clone, Copy)]
pub struct Layout {
    pub name: &'static str,
    pub sessions: usize,
    pub threads: OpThreads,
}

impl Layout {
    /// The layouts a CPU of `cores` cores can run the model in, for `celer bench local
    /// --model-only`: one session on every core (what a lone request gets in `celer
    /// serve`), `replicas` sessions of `threads` each (serve's replicas under load), and
    /// `replicas` sessions on ONNX Runtime's shared pool of `cores` threads (the shared
    /// pool must be set up first: `crate::ort::session::share_pool`).
    pub fn candidates(cores: usize, replicas: usize, threads: usize) -> Vec<Layout> {
        let mut layouts = vec![Layout {
            name: "solo",
            sessions: 1,
            threads: OpThreads::Own {
                threads: cores,
                alone: true,
            },
        }];
        if replicas > 1 {
            layouts.push(Layout {
                name: "replicas",
                sessions: replicas,
                threads: threads.into(),
            });
            layouts.push(Layout {
                name: "shared-pool",
                sessions: replicas,
                threads: OpThreads::Shared,
            });
        }
        layouts
    }
}

/// What a layout did: runs per second over all its sessions, and the median time of
/// one run.
#[derive(Debug, Clone, serde::Serialize)]
pub struct LayoutRate {
    pub layout: &'static str,
    pub sessions: usize,
    pub threads: String,
    pub runs_per_s: f64,
    pub run_p50_ms: f64,
    /// Megabytes mapped afresh per run (the kernel zeroes them): what the block cache
    /// saves, or does not.
    pub mapped_mb_per_run: f64,
    /// This process's CPU time per run (all threads: the sessions' own, spinning
    /// included), from Linux's /proc; `None` elsewhere.
    pub cpu_ms_per_run: Option<f64>,
}

/// The segmentation model alone in `layout` for `duration`, on a constant input.
pub fn model_only(
    spec: &PipelineSpec,
    layout: Layout,
    duration: Duration,
) -> Result<LayoutRate, LocalBenchError> {
    let seg = &spec.segmentation;
    let shape = [1, 3, seg.image.height as usize, seg.image.width as usize];
    let input = vec![0.5f32; shape.iter().product()];
    let mut models = (0..layout.sessions.max(1))
        .map(|_| crate::replica::models::segmentation(spec).load_ort(layout.threads))
        .collect::<Result<Vec<_>, _>>()?;
    // One warm-up run each: the first run allocates.
    for m in &mut models {
        m.run(&[(seg.image.input.as_str(), shape, &input)], &seg.output)?;
    }
    let stop = AtomicBool::new(false);
    let mapped_before = crate::ort::allocator::stats().mapped_bytes;
    let cpu_before = super::cpu::of_self();
    let per_session = std::thread::scope(|scope| {
        let handles: Vec<_> = models
            .iter_mut()
            .map(|m| {
                let (stop, input) = (&stop, &input);
                scope.spawn(move || -> Result<Vec<Duration>, OrtError> {
                    let mut runs = Vec::new();
                    while !stop.load(Ordering::Relaxed) {
                        let t = Instant::now();
                        m.run(&[(seg.image.input.as_str(), shape, input)], &seg.output)?;
                        runs.push(t.elapsed());
                    }
                    Ok(runs)
                })
            })
            .collect();
        std::thread::sleep(duration);
        stop.store(true, Ordering::Relaxed);
        handles
            .into_iter()
            .map(|h| match h.join() {
                Ok(runs) => runs.map_err(LocalBenchError::from),
                Err(_) => Err(LocalBenchError::SessionPanicked),
            })
            .collect::<Result<Vec<_>, _>>()
    })?;
    let cpu_after = super::cpu::of_self();
    let mapped = crate::ort::allocator::stats().mapped_bytes - mapped_before;
    // The rate of each session is its runs over the time they took back to back; the
    // layout's is their sum. (All the runs over the time until the last session's last
    // run ends waits for the slowest: low by a fraction of a run.) The CPU time is
    // counted to the end of every run, so per run it has no such edge.
    let runs_per_s = per_session
        .iter()
        .map(|runs| {
            let busy: f64 = runs.iter().map(Duration::as_secs_f64).sum();
            if busy > 0.0 {
                runs.len() as f64 / busy
            } else {
                0.0
            }
        })
        .sum();
    let mut runs: Vec<Duration> = per_session.into_iter().flatten().collect();
    runs.sort();
    Ok(LayoutRate {
        layout: layout.name,
        sessions: layout.sessions,
        threads: match layout.threads {
            OpThreads::Own { threads, alone } => {
                format!("{threads} own{}", if alone { ", spinning" } else { "" })
            }
            OpThreads::Shared => "shared pool".into(),
        },
        runs_per_s,
        run_p50_ms: runs
            .get(runs.len() / 2)
            .map_or(0.0, |d| d.as_secs_f64() * 1e3),
        mapped_mb_per_run: mapped as f64 / 1e6 / runs.len().max(1) as f64,
        cpu_ms_per_run: super::cpu::ms_per(cpu_before, cpu_after, runs.len() as u64),
    })
}

/// One GPU request's cost to the replica thread, in CPU time.
#[derive(Debug, Clone, Copy, Default)]
pub struct GpuHostCpu {
    /// The thread's CPU time in `GpuStages::run`: everything between decode and encode.
    pub run: Duration,
    /// Of which, waiting for the stream. On a GPU the wait sleeps; on the stand-in CUDA
    /// driver the device's work (kernels, the stand-in TensorRT's engines) runs there.
    pub waits: Duration,
    /// Of which, the models on the host (ONNX Runtime, where the GPU has no engines).
    pub host_model: Duration,
}

impl GpuHostCpu {
    /// The replica thread's own work: run, less the waits and the host's models.
    pub fn host(&self) -> Duration {
        self.run
            .saturating_sub(self.waits)
            .saturating_sub(self.host_model)
    }
}

/// Runs `image_bytes` (decoded once into bytes from `pixels`, as a server's decode would
/// hand it over) `warmup + iterations` times through one GPU replica's stages, answering
/// `output`; returns each measured request's stage times and host CPU.
pub fn gpu_host_cpu(
    stages: &mut GpuStages,
    pixels: &dyn HostAlloc,
    image_bytes: &[u8],
    output: OutputKind,
    warmup: usize,
    iterations: usize,
) -> Result<Vec<(StageTimings, GpuHostCpu)>, LocalBenchError> {
    let image = Arc::new(decode_into(image_bytes, &DecodeLimits::default(), pixels)?);
    let planes = crate::codec::planes_of(output);
    let models_on_host = stages.model_backend() != "TensorRT";
    stages.measure_waits(Some(super::cpu::of_this_thread));
    let mut measured = Vec::with_capacity(iterations);
    for i in 0..warmup + iterations {
        let mut timings = StageTimings::default();
        let before = super::cpu::of_this_thread().ok_or(LocalBenchError::NoThreadClock)?;
        stages.run(&image, planes, &mut timings)?;
        let after = super::cpu::of_this_thread().ok_or(LocalBenchError::NoThreadClock)?;
        if i >= warmup {
            measured.push((
                timings,
                GpuHostCpu {
                    run: after.saturating_sub(before),
                    waits: stages.last_wait_cpu(),
                    host_model: if models_on_host {
                        timings.model
                    } else {
                        Duration::ZERO
                    },
                },
            ));
        }
    }
    stages.measure_waits(None);
    Ok(measured)
}

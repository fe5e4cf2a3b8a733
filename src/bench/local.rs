//! In-process benchmarks, no HTTP (what trtexec is to TensorRT): the time of each stage
//! of the pipeline on one image, and the rate at which the backend alone runs the
//! segmentation model on the same replicas and threads (the limit a server can approach).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::backend::BackendError;
use crate::codec::decode::{decode, DecodeLimits};
use crate::codec::{render, RenderError};
use crate::config::{OutputKind, PipelineSpec};
use crate::pipeline::StageTimings;
use crate::replica::cpu::{timed_cutout, CpuPipeline, PipelineError};

#[derive(Debug, thiserror::Error)]
pub enum LocalBenchError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    #[error(transparent)]
    Render(#[from] RenderError),
    #[error(transparent)]
    Model(#[from] crate::replica::models::ModelError),
    #[error("cannot decode the benchmark image: {0}")]
    Decode(#[from] crate::codec::decode::DecodeError),
}

/// Runs decode + pipeline + render on `image_bytes` `warmup + iterations` times on one
/// replica with `threads` ONNX Runtime threads; returns the measured iterations' timings.
pub fn stage_timings(
    spec: &PipelineSpec,
    image_bytes: &[u8],
    output: OutputKind,
    threads: usize,
    warmup: usize,
    iterations: usize,
) -> Result<Vec<StageTimings>, LocalBenchError> {
    let mut pipeline = CpuPipeline::load(spec, threads)?;
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
        render(&matte, cutout.as_ref(), output, &mut timings)?;
        if i >= warmup {
            measured.push(timings);
        }
    }
    Ok(measured)
}

/// The model alone: `replicas` threads, each with its own session of `threads` threads,
/// running the segmentation model back to back for `duration`. Returns runs per second.
pub fn model_only_rate(
    spec: &PipelineSpec,
    replicas: usize,
    threads: usize,
    duration: Duration,
) -> Result<f64, LocalBenchError> {
    let seg = &spec.segmentation;
    let shape = [1, 3, seg.image.height as usize, seg.image.width as usize];
    let input = vec![0.5f32; shape.iter().product()];
    let mut models = (0..replicas.max(1))
        .map(|_| crate::replica::models::segmentation(spec).load_ort(threads))
        .collect::<Result<Vec<_>, _>>()?;
    // One warm-up run each: the first run allocates.
    for m in &mut models {
        m.run(&[(seg.image.input.as_str(), shape, &input)], &seg.output)?;
    }
    let runs = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let started = Instant::now();
    let failed = std::thread::scope(|scope| {
        let handles: Vec<_> = models
            .iter_mut()
            .map(|m| {
                let (runs, stop, input) = (runs.clone(), stop.clone(), &input);
                scope.spawn(move || -> Result<(), BackendError> {
                    while !stop.load(Ordering::Relaxed) {
                        m.run(&[(seg.image.input.as_str(), shape, input)], &seg.output)?;
                        runs.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(())
                })
            })
            .collect();
        std::thread::sleep(duration);
        stop.store(true, Ordering::Relaxed);
        handles
            .into_iter()
            .filter_map(|h| h.join().ok().and_then(Result::err))
            .next()
    });
    if let Some(e) = failed {
        return Err(e.into());
    }
    Ok(runs.load(Ordering::Relaxed) as f64 / started.elapsed().as_secs_f64())
}

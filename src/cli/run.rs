//! `celer run`: offline inference on files and folders. Each image is decoded, matted by
//! the replicas and written to the output folder; a failed image is reported and the
//! batch goes on. The summary gives the median time of each stage.

use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use super::args::{DeviceArgs, RuntimeArgs};
use crate::codec::decode::{decode_into, image_files, DecodeLimits};
use crate::codec::render;
use crate::matte::StageTimings;
use crate::pixels::HostAlloc;
use crate::replica::{BoxedMatteExecutor, MatteJob, MatteScheduler};
use crate::sched::{Scheduler, SchedulerConfig, Ticket};
use crate::spec::OutputKind;

#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    #[command(flatten)]
    pub runtime: RuntimeArgs,

    #[command(flatten)]
    pub device: DeviceArgs,

    /// Image files, or folders whose images (JPEG, PNG, WebP, BMP, TIFF, GIF) are taken.
    #[arg(required = true)]
    pub inputs: Vec<PathBuf>,

    /// Output folder (created if missing).
    #[arg(short, long)]
    pub output_dir: PathBuf,

    /// cutout (RGBA PNG), alpha, trimap, or json. Default: the pipeline's.
    #[arg(long)]
    pub output: Option<OutputKind>,
}

pub fn run(args: RunArgs) -> anyhow::Result<()> {
    let spec = super::load_pipeline(&args.runtime.model_dir)?;
    let output = args.output.unwrap_or(spec.default_output);
    let files = collect_inputs(&args.inputs)?;
    std::fs::create_dir_all(&args.output_dir)
        .with_context(|| format!("cannot create {}", args.output_dir.display()))?;
    crate::ort::session::environment()?;
    let super::devices::ServingDevices { setups, pixels, .. } = super::devices::device_setups(
        &spec,
        &args.runtime.model_dir,
        &args.runtime.replicas(),
        &args.device.devices(),
        DecodeLimits::default().max_pixels,
    )?;
    // Two images per replica in flight: one running, one decoded and waiting.
    let in_flight = setups.iter().map(|d| d.replicas).sum::<usize>() * 2;
    let pool = Scheduler::start(
        setups,
        SchedulerConfig {
            queue_capacity: in_flight,
            ..SchedulerConfig::default()
        },
    );
    pool.wait_ready()
        .map_err(|e| anyhow::anyhow!("the models failed to load: {e}"))?;
    // Waits for answers (and their deadline timers) from this thread.
    let waiter = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .context("starting the async runtime")?;

    let bar = ProgressBar::new(files.len() as u64).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} {elapsed} eta {eta} {msg}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let started = Instant::now();
    let mut summary = Summary::default();
    let mut pending: VecDeque<Pending> = VecDeque::new();
    for file in &files {
        match submit(&pool, file, output, pixels.as_ref()) {
            Ok(p) => pending.push_back(p),
            Err(e) => summary.fail(&bar, file, &e),
        }
        if pending.len() >= in_flight {
            if let Some(p) = pending.pop_front() {
                finish(&waiter, p, &args.output_dir, output, &mut summary, &bar);
            }
        }
    }
    while let Some(p) = pending.pop_front() {
        finish(&waiter, p, &args.output_dir, output, &mut summary, &bar);
    }
    bar.finish_and_clear();
    summary.print(started.elapsed());
    pool.shutdown();
    if summary.ok == 0 && summary.failed > 0 {
        anyhow::bail!("every image failed");
    }
    Ok(())
}

struct Pending {
    file: PathBuf,
    ticket: Ticket<BoxedMatteExecutor>,
}

fn submit(
    pool: &MatteScheduler,
    file: &Path,
    output: OutputKind,
    pixels: &dyn HostAlloc,
) -> anyhow::Result<Pending> {
    let bytes = std::fs::read(file).context("cannot read")?;
    let t = Instant::now();
    let image = Arc::new(decode_into(&bytes, &DecodeLimits::default(), pixels)?);
    let timings = StageTimings {
        decode: t.elapsed(),
        ..StageTimings::default()
    };
    // The pool's queue holds `in_flight` jobs and we never have more outstanding.
    let job = MatteJob::new(image, timings, crate::codec::planes_of(output));
    // Priced by its pixels, as the server prices a request.
    let ticket = pool.submit_priced(job, Instant::now() + Duration::from_secs(3600))?;
    Ok(Pending {
        file: file.to_path_buf(),
        ticket,
    })
}

fn finish(
    waiter: &tokio::runtime::Runtime,
    p: Pending,
    out_dir: &Path,
    output: OutputKind,
    summary: &mut Summary,
    bar: &ProgressBar,
) {
    let result = (|| -> anyhow::Result<StageTimings> {
        let done = waiter.block_on(p.ticket.wait())?;
        let mut timings = done.output.timings;
        let rendered = render(&done.output.planes, output, &mut timings)?;
        let ext = if output == OutputKind::Json {
            "json"
        } else {
            "png"
        };
        let stem = p.file.file_stem().unwrap_or_default().to_string_lossy();
        let dest = out_dir.join(format!("{stem}.{ext}"));
        std::fs::write(&dest, rendered.body)
            .with_context(|| format!("cannot write {}", dest.display()))?;
        Ok(timings)
    })();
    match result {
        Ok(t) => {
            summary.ok += 1;
            summary.timings.push(t);
            bar.inc(1);
        }
        Err(e) => summary.fail(bar, &p.file, &e),
    }
}

fn collect_inputs(inputs: &[PathBuf]) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for input in inputs {
        if input.is_dir() {
            files.extend(
                image_files(input).with_context(|| format!("cannot read {}", input.display()))?,
            );
        } else {
            files.push(input.clone());
        }
    }
    if files.is_empty() {
        anyhow::bail!("no images found in the inputs");
    }
    Ok(files)
}

#[derive(Default)]
struct Summary {
    ok: usize,
    failed: usize,
    timings: Vec<StageTimings>,
}

impl Summary {
    fn fail(&mut self, bar: &ProgressBar, file: &Path, e: &anyhow::Error) {
        self.failed += 1;
        bar.println(format!("failed: {}: {e:#}", file.display()));
        bar.inc(1);
    }

    fn print(&self, elapsed: Duration) {
        println!(
            "{} images done, {} failed, in {:.2} s",
            self.ok,
            self.failed,
            elapsed.as_secs_f64()
        );
        if self.timings.is_empty() {
            return;
        }
        println!("median per stage (ms):");
        let rows = crate::bench::report::stage_percentiles(&self.timings);
        for (name, p50, ..) in rows.iter().filter(|row| row.0 != "total") {
            println!("  {name:<10} {p50:>9.2}");
        }
    }
}

//! `celer bench http` (load against a running server) and `celer bench local`
//! (in-process stage timings, and the model-only limit).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressStyle};

use super::args::RuntimeArgs;
use crate::bench::http::{
    load_inputs, run_point, run_turns, LoadMode, LoadTarget, Payload, Window,
};
use crate::bench::local::Layout;
use crate::bench::report::{self, stage_percentiles, PointReport};
use crate::host::cpus::CpuBudget;
use crate::quantize::variant::Target;
use crate::spec::{OutputKind, PipelineSpec};

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Load against a running server's /invocations.
    Http(HttpArgs),
    /// In-process, no HTTP: per-stage times on one image, or the model alone.
    Local(LocalArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Arrivals {
    Poisson,
    Constant,
}

#[derive(Debug, Args)]
pub struct HttpArgs {
    /// Base URL of the server (its /invocations is loaded, with --route v2 its
    /// /v2/models/{model}/infer, with --route grpc its gRPC port's ModelInfer). Given more than once: one client takes turns between
    /// the servers, a request to each in order, at concurrency 1 (the servers' latencies
    /// seconds apart, for a ratio on a noisy machine); --label, --server-pid and --json
    /// are then given once per URL, in the same order.
    #[arg(long, default_value = "http://127.0.0.1:8080")]
    url: Vec<String>,
    /// The route loaded: SageMaker's /invocations, or the Open Inference Protocol's infer
    /// with the image as a binary BYTES tensor, over REST (`v2`: the binary-data
    /// extension) or gRPC (`grpc`: raw contents; the --url is the gRPC port's, e.g.
    /// http://127.0.0.1:8001). Once for every --url, or once per --url in the same order
    /// (REST and gRPC taking turns, side by side).
    #[arg(long, value_enum, default_values_t = [Route::Invocations])]
    route: Vec<Route>,
    /// The model name of --route v2 and grpc.
    #[arg(long, default_value = "celer")]
    model_name: String,
    /// The output --route v2 and grpc ask for, in binary (`cutout`: the PNG /invocations answers
    /// by default; `alpha`, `trimap`).
    #[arg(long, default_value = "cutout")]
    v2_output: String,
    /// An image, or a folder of images sent round robin. Given more than once (mixed
    /// traffic): the inputs are sent in turn, as often each, and the report gives each
    /// its own percentiles.
    #[arg(long, required = true)]
    input: Vec<PathBuf>,
    /// The client's deadline: sent with each request (`deadline-ms=` in the custom
    /// attributes; the `deadline_ms` parameter over v2 and gRPC), and a success slower
    /// than it is counted late.
    #[arg(long)]
    deadline_ms: Option<u64>,
    /// A closed-loop client refused with a `Retry-After` waits that long before its next
    /// request, as an SDK's retry would (by default it sends the next at once: a flood).
    #[arg(long)]
    honor_retry_after: bool,
    /// Closed-loop concurrencies to sweep, e.g. 1,2,4,8.
    #[arg(long, value_delimiter = ',')]
    concurrency: Vec<usize>,
    /// Open-loop offered rates (requests/s) to sweep, e.g. 5,10,20.
    #[arg(long, value_delimiter = ',')]
    rate: Vec<f64>,
    /// Arrival process of the open loop.
    #[arg(long, value_enum, default_value_t = Arrivals::Poisson)]
    arrivals: Arrivals,
    /// Measured seconds per point.
    #[arg(long, default_value_t = 20.0)]
    duration_s: f64,
    /// Stop a point after this many measured requests, if sooner.
    #[arg(long)]
    requests: Option<u64>,
    /// Seconds of load before measuring, per point.
    #[arg(long, default_value_t = 3.0)]
    warmup_s: f64,
    /// Accept header to send (e.g. application/json).
    #[arg(long)]
    accept: Option<String>,
    /// X-Amzn-SageMaker-Custom-Attributes to send (e.g. output=alpha).
    #[arg(long)]
    custom_attributes: Option<String>,
    /// The server's process id, when it runs on this machine: each point then reports
    /// the server's CPU time per request (and this tool's own), from Linux's /proc.
    #[arg(long)]
    server_pid: Vec<u32>,
    /// Label for the plot title and the reports.
    #[arg(long, default_value = "celer")]
    label: Vec<String>,
    /// Write the points as JSON here.
    #[arg(long)]
    json: Vec<PathBuf>,
    /// Write the points as CSV here.
    #[arg(long)]
    csv: Option<PathBuf>,
    /// Write a latency-versus-throughput SVG of the sweep here.
    #[arg(long)]
    plot: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct LocalArgs {
    #[command(flatten)]
    runtime: RuntimeArgs,
    /// The image to run (for the stage timings).
    #[arg(long)]
    image: Option<PathBuf>,
    /// Measured iterations.
    #[arg(long, default_value_t = 20)]
    iterations: usize,
    /// Unmeasured iterations first.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// cutout, alpha, trimap or json: what is composited and encoded.
    #[arg(long, default_value = "cutout")]
    output: OutputKind,
    /// Measure only the segmentation model's rate on the replicas and threads given.
    #[arg(long)]
    model_only: bool,
    /// Seconds for --model-only, per layout.
    #[arg(long, default_value_t = 20.0)]
    duration_s: f64,
    /// With --model-only: only this layout (solo, replicas or shared-pool; may be given
    /// more than once), e.g. the best one, measured between a server's load points.
    #[arg(long = "layout")]
    layouts: Vec<String>,
    /// Write the result as JSON here.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Run the stages on this GPU (one replica, from its engines, else with ONNX Runtime
    /// for the models) and report the replica thread's CPU time per request outside
    /// decode, encode, the device and the models.
    #[arg(long)]
    gpu: Option<u32>,
    /// Where the engines and the `celer build --precision` variants are (default: the
    /// model folder's engines/).
    #[arg(long)]
    engines_dir: Option<PathBuf>,
    /// Run the FP32 models even where a variant passed its quality gate (by default the
    /// CPU runs the INT8 variant, as `celer serve` does).
    #[arg(long, env = "CELER_FP32", default_value_t = false, value_parser = clap::builder::BoolishValueParser::new())]
    fp32: bool,
}

/// Which protocol `celer bench http` speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Route {
    Invocations,
    V2,
    Grpc,
}

pub fn bench(command: BenchCommand) -> anyhow::Result<()> {
    match command {
        BenchCommand::Http(args) => http(args),
        BenchCommand::Local(args) => local(args),
    }
}

/// Each `--input`: its name, and its images with their content types.
type Inputs = Vec<(String, Vec<(bytes::Bytes, &'static str)>)>;

fn read_inputs(paths: &[PathBuf]) -> anyhow::Result<Inputs> {
    paths
        .iter()
        .map(|path| {
            let images =
                load_inputs(path).with_context(|| format!("cannot read {}", path.display()))?;
            anyhow::ensure!(!images.is_empty(), "no images in {}", path.display());
            let name = path.file_name().map_or_else(
                || path.display().to_string(),
                |n| n.to_string_lossy().into(),
            );
            Ok((name, images))
        })
        .collect()
}

fn http(args: HttpArgs) -> anyhow::Result<()> {
    let inputs = read_inputs(&args.input)?;
    if args.url.len() > 1 {
        return turns(&args, &inputs);
    }
    let (Some(base), [], [], []) = (
        args.url.first(),
        args.server_pid.get(1..).unwrap_or_default(),
        args.label.get(1..).unwrap_or_default(),
        args.json.get(1..).unwrap_or_default(),
    ) else {
        anyhow::bail!("one --url takes one --server-pid, --label and --json at most");
    };
    let label = args.label.first().map_or("celer", String::as_str);
    let mut modes: Vec<LoadMode> = args
        .concurrency
        .iter()
        .map(|&c| LoadMode::Closed { concurrency: c })
        .collect();
    modes.extend(args.rate.iter().map(|&rate| LoadMode::Open {
        rate,
        poisson: args.arrivals == Arrivals::Poisson,
    }));
    if modes.is_empty() {
        modes.push(LoadMode::Closed { concurrency: 1 });
    }
    anyhow::ensure!(args.route.len() == 1, "one --url takes one --route");
    let target = Arc::new(load_target(&args, args.route[0], base, &inputs)?);
    let window = window(&args);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let points: Vec<PointReport> = runtime.block_on(async {
        let client = load_client()?;
        let mut points = Vec::new();
        for mode in modes {
            let progress = progress()?;
            let point = run_point(
                &client,
                target.clone(),
                mode,
                window,
                args.server_pid.first().copied(),
                &progress,
            )
            .await;
            progress.finish_and_clear();
            say(label, &point);
            points.push(point);
        }
        anyhow::Ok(points)
    })?;
    print!("{}", report::table(&points));
    if let Some(path) = args.json.first() {
        report::write_json(path, &points).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.csv {
        report::write_csv(path, &points).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.plot {
        report::write_plot(path, label, &points)
            .map_err(|e| anyhow::anyhow!("writing {}: {e}", path.display()))?;
    }
    Ok(())
}

/// `bench http` with several URLs: one client taking turns between them at c=1.
fn turns(args: &HttpArgs, inputs: &Inputs) -> anyhow::Result<()> {
    let n = args.url.len();
    anyhow::ensure!(
        args.concurrency.iter().all(|&c| c == 1) && args.rate.is_empty(),
        "several --url take turns at concurrency 1 only: at more, the servers would \
         compete for the same cores"
    );
    anyhow::ensure!(
        args.csv.is_none() && args.plot.is_none(),
        "several --url write JSON only (--json, once per URL)"
    );
    anyhow::ensure!(
        args.label.len() == n
            && [1, n].contains(&args.route.len())
            && [0, n].contains(&args.server_pid.len())
            && [0, n].contains(&args.json.len()),
        "{n} URLs need {n} --label, one or {n} --route, and {n} or no --server-pid and --json"
    );
    let targets = args
        .url
        .iter()
        .enumerate()
        .map(|(i, base)| {
            let route = args.route[i.min(args.route.len() - 1)];
            load_target(args, route, base, inputs).map(Arc::new)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;
    let pids: Vec<Option<u32>> = (0..n).map(|i| args.server_pid.get(i).copied()).collect();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let points = runtime.block_on(async {
        let client = load_client()?;
        let progress = progress()?;
        let points = run_turns(&client, &targets, window(args), &pids, &progress).await;
        progress.finish_and_clear();
        anyhow::Ok(points)
    })?;
    for (i, (label, point)) in args.label.iter().zip(&points).enumerate() {
        say(label, point);
        print!("{}", report::table(std::slice::from_ref(point)));
        if let Some(path) = args.json.get(i) {
            report::write_json(path, std::slice::from_ref(point))
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(())
}

/// What each request of `bench http` sends to the server at `base`.
fn load_target(
    args: &HttpArgs,
    route: Route,
    base: &str,
    inputs: &Inputs,
) -> anyhow::Result<LoadTarget> {
    let base = base.trim_end_matches('/');
    let deadline = args.deadline_ms;
    let payload = |(image, content_type): &(bytes::Bytes, &'static str)| match route {
        Route::Invocations => Payload::invocations((image.clone(), content_type)),
        Route::V2 => Payload::v2_infer(image, &args.v2_output, deadline),
        Route::Grpc => Payload::grpc_infer(image, &args.v2_output, &args.model_name, deadline),
    };
    let url = match route {
        Route::Invocations => format!("{base}/invocations"),
        Route::V2 => format!("{base}/v2/models/{}/infer", args.model_name),
        Route::Grpc => format!("{base}/inference.GRPCInferenceService/ModelInfer"),
    };
    // Interleaved, so that the round robin sends the inputs in turn: the first image of
    // each, then the second of each, ...
    let longest = inputs
        .iter()
        .map(|(_, images)| images.len())
        .max()
        .unwrap_or(0);
    let payloads = (0..longest)
        .flat_map(|k| {
            inputs
                .iter()
                .enumerate()
                .map(move |(input, (_, images))| (input, &images[k % images.len()]))
        })
        .map(|(input, image)| payload(image).of_input(input))
        .collect();
    let custom_attributes = match (&args.custom_attributes, deadline, route) {
        (Some(attrs), Some(ms), Route::Invocations) => Some(format!("{attrs};deadline-ms={ms}")),
        (None, Some(ms), Route::Invocations) => Some(format!("deadline-ms={ms}")),
        (attrs, _, _) => attrs.clone(),
    };
    let client = match route {
        Route::Grpc => Some(
            reqwest::Client::builder()
                .no_proxy()
                .http2_prior_knowledge()
                .build()?,
        ),
        Route::Invocations | Route::V2 => None,
    };
    Ok(LoadTarget {
        url,
        inputs: payloads,
        input_names: inputs.iter().map(|(name, _)| name.clone()).collect(),
        late_after: deadline.map(Duration::from_millis),
        honor_retry_after: args.honor_retry_after,
        accept: args.accept.clone(),
        custom_attributes,
        client,
    })
}

fn window(args: &HttpArgs) -> Window {
    Window {
        warmup: Duration::from_secs_f64(args.warmup_s),
        duration: Duration::from_secs_f64(args.duration_s),
        max_requests: args.requests,
    }
}

fn load_client() -> anyhow::Result<reqwest::Client> {
    Ok(reqwest::Client::builder()
        .no_proxy()
        .pool_max_idle_per_host(1024)
        .build()?)
}

fn progress() -> anyhow::Result<ProgressBar> {
    let progress = ProgressBar::new_spinner()
        .with_style(ProgressStyle::with_template("{spinner} {elapsed} {msg}")?);
    progress.enable_steady_tick(Duration::from_millis(120));
    Ok(progress)
}

/// One line on stderr per point.
fn say(label: &str, point: &PointReport) {
    let cpu = match (
        point.server_cpu_ms_per_request,
        point.client_cpu_ms_per_request,
    ) {
        (Some(server), Some(client)) => {
            format!(", CPU per request: server {server:.1} ms, this client {client:.1} ms")
        }
        _ => String::new(),
    };
    eprintln!(
        "{label} {}: {:.2} req/s, p50 {:.1} ms, p99 {:.1} ms{cpu}",
        point.point, point.throughput_rps, point.latency_ms.p50, point.latency_ms.p99
    );
}

/// The model alone in each layout the cores allow; the best rate is the limit a server
/// can approach under load, the solo layout's run time a lone request's model time.
fn model_only(
    spec: &PipelineSpec,
    args: &LocalArgs,
    replicas: usize,
    threads: usize,
) -> anyhow::Result<()> {
    let cores = CpuBudget::get().cores;
    crate::ort::session::share_pool(cores)?;
    let duration = Duration::from_secs_f64(args.duration_s);
    let mut rates = Vec::new();
    println!(
        "model only: {} on {cores} cores",
        spec.segmentation.image.model.display()
    );
    println!(
        "{:<12} {:>8} {:>20} {:>10} {:>11} {:>15} {:>15}",
        "layout", "sessions", "threads each", "runs/s", "run p50 ms", "MB mapped/run", "CPU ms/run"
    );
    let candidates = Layout::candidates(cores, replicas, threads);
    if let Some(unknown) = args
        .layouts
        .iter()
        .find(|name| !candidates.iter().any(|l| l.name == name.as_str()))
    {
        let known: Vec<_> = candidates.iter().map(|l| l.name).collect();
        anyhow::bail!(
            "no layout {unknown:?} on {cores} cores with {replicas} replicas (there are: {})",
            known.join(", ")
        );
    }
    let chosen = candidates
        .into_iter()
        .filter(|l| args.layouts.is_empty() || args.layouts.iter().any(|n| n == l.name));
    for layout in chosen {
        let rate = crate::bench::local::model_only(spec, layout, duration)?;
        println!(
            "{:<12} {:>8} {:>20} {:>10.2} {:>11.1} {:>15.1} {:>15}",
            rate.layout,
            rate.sessions,
            rate.threads,
            rate.runs_per_s,
            rate.run_p50_ms,
            rate.mapped_mb_per_run,
            rate.cpu_ms_per_run
                .map_or_else(|| "-".to_string(), |ms| format!("{ms:.1}"))
        );
        println!("  {}", crate::ort::allocator::stats());
        // The next layout starts as a busy device would: nothing cached.
        crate::ort::allocator::release_cached();
        rates.push(rate);
    }
    let best = rates
        .iter()
        .max_by(|a, b| a.runs_per_s.total_cmp(&b.runs_per_s))
        .context("no layout measured")?;
    println!(
        "best layout: {} ({:.2} runs/s)",
        best.layout, best.runs_per_s
    );
    if let Some(path) = &args.json {
        let json = serde_json::json!({
            "cores": cores,
            "layouts": rates,
            "best": best,
        });
        std::fs::write(path, serde_json::to_vec_pretty(&json)?)?;
    }
    Ok(())
}

fn local(args: LocalArgs) -> anyhow::Result<()> {
    let declared = super::load_pipeline(&args.runtime.model_dir)?;
    let (replicas, threads) = args.runtime.replicas().on_cpu();
    // What `celer serve` would run: on the CPU the INT8 variant, on a GPU the FP16 one,
    // where one passed its gate.
    let target = if args.gpu.is_some() {
        Target::Gpu
    } else {
        Target::Cpu
    };
    let (spec, _) = super::devices::with_variants(
        &declared,
        &args.runtime.model_dir,
        args.engines_dir.clone(),
        args.fp32,
        target,
    );
    if args.model_only {
        return model_only(&spec, &args, replicas, threads);
    }
    let image = args
        .image
        .as_ref()
        .context("--image is needed for the stage timings (or pass --model-only)")?;
    let bytes = std::fs::read(image).with_context(|| format!("cannot read {}", image.display()))?;
    let output = args.output;
    if let Some(ordinal) = args.gpu {
        return local_gpu(&spec, &args, ordinal, threads, &bytes);
    }
    // One replica, the only one running: the latency of a lone request.
    let solo_threads = args.runtime.replicas().solo(threads);
    let timings = crate::bench::local::stage_timings(
        &spec,
        &bytes,
        output,
        (threads, solo_threads),
        args.warmup,
        args.iterations,
    )?;
    let rows = stage_percentiles(&timings);
    println!(
        "{} iterations of {} ({solo_threads} threads)",
        timings.len(),
        image.display()
    );
    println!(
        "{:<11} {:>9} {:>9} {:>9}",
        "stage", "p50 ms", "p90 ms", "p99 ms"
    );
    for (name, p50, p90, p99) in &rows {
        println!("{name:<11} {p50:>9.2} {p90:>9.2} {p99:>9.2}");
    }
    println!("{}", crate::ort::allocator::stats());
    if let Some(path) = &args.json {
        let json: serde_json::Map<String, serde_json::Value> = rows
            .iter()
            .map(|(n, p50, p90, p99)| {
                (
                    n.to_string(),
                    serde_json::json!({"p50": p50, "p90": p90, "p99": p99}),
                )
            })
            .collect();
        std::fs::write(path, serde_json::to_vec_pretty(&json)?)?;
    }
    Ok(())
}

/// `celer bench local --gpu N`: one replica of GPU `N` between decode and encode, and the
/// replica thread's CPU time per request: in all, in its waits for the stream, and its own
/// (the host work a request costs: staging, launches, unpacking the download).
fn local_gpu(
    spec: &PipelineSpec,
    args: &LocalArgs,
    ordinal: u32,
    threads: usize,
    bytes: &[u8],
) -> anyhow::Result<()> {
    use crate::replica::gpu::{
        host_pool, GpuLimits, GpuServing, SoloReplica, DEFAULT_BLOCK_PIXELS,
    };

    let probe = crate::cuda::probe();
    let info = probe
        .gpus()
        .iter()
        .find(|g| g.ordinal as u32 == ordinal)
        .cloned()
        .with_context(|| format!("no GPU {ordinal}: {}", probe.summary()))?;
    let model_dir = &args.runtime.model_dir;
    let plan = super::devices::gpu_plans(
        spec,
        model_dir,
        std::slice::from_ref(&info),
        &probe,
        args.engines_dir.as_deref(),
        false,
    )?
    .into_iter()
    .next()
    .context("no plan for the GPU")?;
    let limits = GpuLimits::default();
    let pool = host_pool(1, limits.max_pixels, DEFAULT_BLOCK_PIXELS);
    let serving = GpuServing::new(limits, pool.clone());
    let mut replica = SoloReplica::open(spec, &plan, threads, &serving)?;
    let backend = replica.stages().model_backend();
    let measured = crate::bench::local::gpu_host_cpu(
        replica.stages(),
        &pool,
        bytes,
        args.output,
        args.warmup,
        args.iterations,
    )?;
    let ms = |pick: &dyn Fn(&crate::bench::local::GpuHostCpu) -> Duration| {
        let mut v: Vec<f64> = measured
            .iter()
            .map(|(_, c)| pick(c).as_secs_f64() * 1e3)
            .collect();
        crate::stats::median(&mut v)
    };
    let (run, waits, host) = (ms(&|c| c.run), ms(&|c| c.waits), ms(&|c| c.host()));
    println!(
        "{} requests on GPU {ordinal} ({}, models on {backend}), output {}",
        measured.len(),
        info.name,
        args.output.name()
    );
    println!("replica thread CPU per request, median ms: run {run:.3}, of which waits {waits:.3}; host work {host:.3}");
    if let Some(path) = &args.json {
        let json = serde_json::json!({
            "gpu": ordinal,
            "models": backend,
            "output": args.output.name(),
            "requests": measured.len(),
            "replica_thread_cpu_ms_p50": {"run": run, "waits": waits, "host": host},
        });
        std::fs::write(path, serde_json::to_vec_pretty(&json)?)?;
    }
    Ok(())
}

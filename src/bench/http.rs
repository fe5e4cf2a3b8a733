//! Load against a running server speaking the `/invocations` contract (celer's or any
//! other), or the Open Inference Protocol's `infer` with the image as a binary BYTES
//! tensor, over REST (the binary-data extension) or gRPC (raw contents): closed loop at a concurrency, or open loop at an offered rate with Poisson or
//! constant arrivals (closed loops hide queueing: a slow server slows its own load).
//! Requests started during the warm-up are not measured.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hdrhistogram::Histogram;
use indicatif::ProgressBar;

use super::cpu;
use super::report::{InputReport, Percentiles, PointReport};
use crate::stats::median;

/// One request's body, as sent.
#[derive(Debug, Clone)]
pub struct Payload {
    pub body: Bytes,
    pub content_type: &'static str,
    /// `Inference-Header-Content-Length` (the v2 binary-data extension's JSON length).
    pub inference_header: Option<usize>,
    /// Which of the target's inputs it is (`LoadTarget::input_names`): each input's
    /// latencies are reported apart.
    pub input: usize,
}

impl Payload {
    /// An image as `/invocations` takes it.
    pub fn invocations((body, content_type): (Bytes, &'static str)) -> Self {
        Self {
            body,
            content_type,
            inference_header: None,
            input: 0,
        }
    }

    /// The same body, as input `input` of its target.
    pub fn of_input(self, input: usize) -> Self {
        Self { input, ..self }
    }

    /// An image as the v2 `infer` takes it in binary: the JSON header naming the `image`
    /// input (`BYTES [1]`) and asking for `output` in binary (with `deadline_ms` among the
    /// request's parameters when given), then the one BYTES element (its 4-byte
    /// little-endian length, then the encoded image).
    pub fn v2_infer(image: &[u8], output: &str, deadline_ms: Option<u64>) -> Self {
        let element = image.len() + 4;
        let mut head = serde_json::json!({
            "inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                        "parameters": {"binary_data_size": element}}],
            "outputs": [{"name": output, "parameters": {"binary_data": true}}],
        });
        if let Some(ms) = deadline_ms {
            head["parameters"] = serde_json::json!({ "deadline_ms": ms });
        }
        let head = head.to_string();
        let mut body = Vec::with_capacity(head.len() + element);
        body.extend_from_slice(head.as_bytes());
        body.extend_from_slice(&(image.len() as u32).to_le_bytes());
        body.extend_from_slice(image);
        Self {
            body: Bytes::from(body),
            content_type: "application/octet-stream",
            inference_header: Some(head.len()),
            input: 0,
        }
    }
}

/// gRPC's content type; a payload of it is a gRPC call.
pub const GRPC: &str = "application/grpc";

impl Payload {
    /// An image as gRPC's `ModelInfer` takes it: a `ModelInferRequest` for `model` with
    /// the `image` input (`BYTES [1]`) in raw contents, asking for `output` (with the
    /// `deadline_ms` parameter when given), framed as a gRPC message (an uncompressed
    /// flag, its 4-byte big-endian length, the message).
    pub fn grpc_infer(image: &[u8], output: &str, model: &str, deadline_ms: Option<u64>) -> Self {
        use crate::oip::inference::infer_parameter::ParameterChoice;
        use crate::oip::inference::model_infer_request::{
            InferInputTensor, InferRequestedOutputTensor,
        };
        use crate::oip::inference::InferParameter;
        use prost::Message;
        let mut element = Vec::with_capacity(4 + image.len());
        element.extend_from_slice(&(image.len() as u32).to_le_bytes());
        element.extend_from_slice(image);
        let message = crate::oip::inference::ModelInferRequest {
            model_name: model.to_string(),
            inputs: vec![InferInputTensor {
                name: "image".into(),
                datatype: "BYTES".into(),
                shape: vec![1],
                ..InferInputTensor::default()
            }],
            outputs: vec![InferRequestedOutputTensor {
                name: output.into(),
                ..InferRequestedOutputTensor::default()
            }],
            raw_input_contents: vec![Bytes::from(element)],
            parameters: deadline_ms
                .map(|ms| {
                    let ms = i64::try_from(ms).unwrap_or(i64::MAX);
                    let choice = Some(ParameterChoice::Int64Param(ms));
                    (
                        "deadline_ms".to_string(),
                        InferParameter {
                            parameter_choice: choice,
                        },
                    )
                })
                .into_iter()
                .collect(),
            ..Default::default()
        };
        let mut body = Vec::with_capacity(5 + message.encoded_len());
        body.push(0);
        body.extend_from_slice(&(message.encoded_len() as u32).to_be_bytes());
        message
            .encode(&mut body)
            .expect("a Vec grows to take the message");
        Self {
            body: Bytes::from(body),
            content_type: GRPC,
            inference_header: None,
            input: 0,
        }
    }
}

/// What each request sends.
pub struct LoadTarget {
    /// The route loaded: `/invocations`, or `/v2/models/{m}/infer`.
    pub url: String,
    /// Bodies sent round robin, in one sequence over every client (so that each is sent
    /// as often as the others, whichever client sends it).
    pub inputs: Vec<Payload>,
    /// The name of each input (`Payload::input`), e.g. its file's: the report gives each
    /// its own percentiles.
    pub input_names: Vec<String>,
    /// A success slower than this is late (the client's deadline, `--deadline-ms`):
    /// counted per input.
    pub late_after: Option<Duration>,
    /// A closed-loop client waits out a refusal's `Retry-After` before its next request.
    pub honor_retry_after: bool,
    pub accept: Option<String>,
    pub custom_attributes: Option<String>,
    /// A client of its own, where the shared one cannot speak to it (gRPC: HTTP/2
    /// without TLS).
    pub client: Option<reqwest::Client>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum LoadMode {
    /// `concurrency` clients, each sending its next request when the last one returns.
    Closed { concurrency: usize },
    /// Requests at `rate` per second, exponential (Poisson) or constant gaps.
    Open { rate: f64, poisson: bool },
}

impl LoadMode {
    pub fn label(&self) -> String {
        match self {
            LoadMode::Closed { concurrency } => format!("c={concurrency}"),
            LoadMode::Open { rate, poisson } => {
                format!(
                    "rate={rate}/s {}",
                    if *poisson { "poisson" } else { "const" }
                )
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct Window {
    pub warmup: Duration,
    pub duration: Duration,
    /// Stop after this many measured requests, if sooner than `duration`.
    pub max_requests: Option<u64>,
}

/// Reads a file, or every image of a folder, with the Content-Type its extension says.
pub fn load_inputs(path: &Path) -> std::io::Result<Vec<(Bytes, &'static str)>> {
    let files: Vec<PathBuf> = if path.is_dir() {
        let mut f: Vec<PathBuf> = std::fs::read_dir(path)?
            .flatten()
            .map(|e| e.path())
            .filter(|p| content_type(p).is_some())
            .collect();
        f.sort();
        f
    } else {
        vec![path.to_path_buf()]
    };
    files
        .iter()
        .map(|f| {
            let ct = content_type(f).unwrap_or("application/octet-stream");
            Ok((Bytes::from(std::fs::read(f)?), ct))
        })
        .collect()
}

fn content_type(path: &Path) -> Option<&'static str> {
    match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
        "jpg" | "jpeg" => Some("image/jpeg"),
        "png" => Some("image/png"),
        "webp" => Some("image/webp"),
        "bmp" => Some("image/bmp"),
        _ => None,
    }
}

/// The latencies and outcomes of a set of measured requests: all of a point's, or one
/// input's.
struct Outcomes {
    latency_us: Histogram<u64>,
    ok: u64,
    requests: u64,
    /// Successes slower than the target's `late_after`.
    late: u64,
    errors: BTreeMap<String, u64>,
}

impl Outcomes {
    fn new() -> Self {
        Self {
            latency_us: Histogram::new_with_bounds(1, 3_600_000_000, 3).expect("valid bounds"),
            ok: 0,
            requests: 0,
            late: 0,
            errors: BTreeMap::new(),
        }
    }

    /// A measured request's outcome: its latency when it succeeded, else what went wrong.
    fn record(&mut self, outcome: Result<u64, &str>, late_after: Option<Duration>) {
        self.requests += 1;
        match outcome {
            Ok(elapsed_us) => {
                self.ok += 1;
                let _ = self.latency_us.record(elapsed_us.max(1));
                if late_after.is_some_and(|d| u128::from(elapsed_us) > d.as_micros()) {
                    self.late += 1;
                }
            }
            Err(kind) => *self.errors.entry(kind.to_string()).or_default() += 1,
        }
    }
}

/// What the clients record, shared between them.
struct Recorder {
    all: Outcomes,
    /// By input (`Payload::input`), when there are several.
    by_input: Vec<Outcomes>,
    stages_ms: BTreeMap<String, Vec<f64>>,
    last_done: Instant,
    /// Successful answers that arrived inside the measured window, whenever their
    /// request was sent: the throughput's numerator.
    ok_in_window: u64,
    window: std::ops::Range<Instant>,
    /// The measured requests' time from send to last byte, added up: what a server
    /// taking turns with others spent on this one's (`run_turns`).
    busy: Duration,
}

impl Recorder {
    fn new(window: std::ops::Range<Instant>, inputs: usize) -> Self {
        Self {
            all: Outcomes::new(),
            by_input: if inputs > 1 {
                (0..inputs).map(|_| Outcomes::new()).collect()
            } else {
                Vec::new()
            },
            stages_ms: BTreeMap::new(),
            last_done: window.start,
            ok_in_window: 0,
            window,
            busy: Duration::ZERO,
        }
    }

    /// An answer arrived `at`; `ok` if it was a success.
    fn answered(&mut self, at: Instant, ok: bool) {
        if ok && self.window.contains(&at) {
            self.ok_in_window += 1;
        }
    }
}

/// Requests per second. A run that lasted its whole window: the successes that arrived
/// in it, over its length. In a closed loop that is the rate the server sustained; the
/// successes *sent* in the window over the time to the last answer (the way of the
/// latencies) is low by the time one request takes over the window's length, as the
/// requests in flight when the window opens are not counted but the ones in flight when
/// it closes are waited for: 8 % at 1920x1080 and c=4 in 15 s, more for a slower server.
/// A run stopped early by a request count has no steady state to sample; it counts its
/// requests to their last answer.
fn throughput(r: &Recorder, ran_whole_window: bool) -> f64 {
    let (count, span) = if ran_whole_window {
        (r.ok_in_window, r.window.end - r.window.start)
    } else {
        (r.all.ok, r.last_done.max(r.window.start) - r.window.start)
    };
    if span.is_zero() {
        0.0
    } else {
        count as f64 / span.as_secs_f64()
    }
}

/// CPU time of the server (when its process is known) and of this load generator, and
/// the requests completed (measured or not), read at one moment.
#[derive(Debug, Clone, Copy)]
struct CpuReading {
    server: Option<Duration>,
    client: Option<Duration>,
    completed: u64,
}

impl CpuReading {
    fn now(server_pid: Option<u32>, completed: &AtomicU64) -> Self {
        Self {
            server: server_pid.and_then(cpu::of_process),
            client: cpu::of_self(),
            completed: completed.load(Ordering::SeqCst),
        }
    }
}

/// Runs one point and returns its report. With `server_pid` (the server's process on this
/// machine), the report also says the server's CPU time per request: the CPU time used
/// over the measured window over the requests completed in it, measured or not. The load
/// is steady over the window, so the work done before it on the requests in flight when
/// it opens balances the work left after it on those in flight when it closes. (Counting
/// to the last answer instead, after the load stops, counted the first ones whole and
/// the last ones not at all: 9 % low at 1920x1080 and c=4, where each request takes a
/// second.) A run stopped early by `Window::max_requests` is counted to its end.
pub async fn run_point(
    client: &reqwest::Client,
    target: Arc<LoadTarget>,
    mode: LoadMode,
    window: Window,
    server_pid: Option<u32>,
    progress: &ProgressBar,
) -> PointReport {
    let start = Instant::now();
    let measure_from = start + window.warmup;
    let measure_until = measure_from + window.duration;
    let recorder = Arc::new(Mutex::new(Recorder::new(
        measure_from..measure_until,
        target.input_names.len(),
    )));
    let sent = Arc::new(AtomicU64::new(0));
    let completed = Arc::new(AtomicU64::new(0));
    let reading_at = |at: Instant| {
        let completed = completed.clone();
        tokio::spawn(async move {
            tokio::time::sleep_until(at.into()).await;
            CpuReading::now(server_pid, &completed)
        })
    };
    let (opening, closing) = (reading_at(measure_from), reading_at(measure_until));
    // Whether a request starting now is measured, and whether the run is over.
    let admit = {
        let sent = sent.clone();
        move |now: Instant| -> Option<bool> {
            if now >= measure_until {
                return None;
            }
            if now < measure_from {
                return Some(false);
            }
            let n = sent.fetch_add(1, Ordering::SeqCst);
            if window.max_requests.is_some_and(|max| n >= max) {
                return None;
            }
            Some(true)
        }
    };
    let ticker = {
        let (recorder, progress, label) = (recorder.clone(), progress.clone(), mode.label());
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(250)).await;
                let r = recorder.lock().unwrap_or_else(|p| p.into_inner());
                let now = Instant::now();
                let phase = if now < measure_from {
                    "warm-up"
                } else {
                    "measuring"
                };
                let rate = if now > measure_from {
                    r.ok_in_window as f64 / (now - measure_from).as_secs_f64()
                } else {
                    0.0
                };
                progress.set_message(format!(
                    "{label}: {phase}, {} measured, {rate:.2} req/s, {} errors",
                    r.all.requests,
                    r.all.errors.values().sum::<u64>()
                ));
            }
        })
    };

    let mut tasks = tokio::task::JoinSet::new();
    match mode {
        LoadMode::Closed { concurrency } => {
            // One sequence of inputs over every client: each input is sent as often as
            // the others, though the clients holding the slow ones send fewer requests.
            let next_input = Arc::new(AtomicU64::new(0));
            for _ in 0..concurrency.max(1) {
                let (client, target, recorder, admit, completed, next_input) = (
                    client.clone(),
                    target.clone(),
                    recorder.clone(),
                    admit.clone(),
                    completed.clone(),
                    next_input.clone(),
                );
                tasks.spawn(async move {
                    while let Some(measured) = admit(Instant::now()) {
                        let i = next_input.fetch_add(1, Ordering::Relaxed) as usize;
                        let retry_after =
                            one_request(&client, &target, i, measured, &recorder).await;
                        completed.fetch_add(1, Ordering::SeqCst);
                        if let (true, Some(wait)) = (target.honor_retry_after, retry_after) {
                            let until = (Instant::now() + wait).min(measure_until);
                            tokio::time::sleep_until(until.into()).await;
                        }
                    }
                });
            }
        }
        LoadMode::Open { rate, poisson } => {
            let rate = rate.max(1e-3);
            let mut next = Instant::now();
            let mut i = 0usize;
            loop {
                tokio::time::sleep_until(next.into()).await;
                let Some(measured) = admit(Instant::now()) else {
                    break;
                };
                let (client, target, recorder, completed) = (
                    client.clone(),
                    target.clone(),
                    recorder.clone(),
                    completed.clone(),
                );
                tasks.spawn(async move {
                    one_request(&client, &target, i, measured, &recorder).await;
                    completed.fetch_add(1, Ordering::SeqCst);
                });
                i += 1;
                let gap = if poisson {
                    // Exponential inter-arrival times: -ln(U) / rate.
                    let u = fastrand::f64().max(f64::MIN_POSITIVE);
                    -u.ln() / rate
                } else {
                    1.0 / rate
                };
                next += Duration::from_secs_f64(gap);
            }
        }
    }
    while tasks.join_next().await.is_some() {}
    ticker.abort();
    let ran_whole_window = closing.is_finished();
    let closing = if ran_whole_window {
        closing.await.ok()
    } else {
        // Stopped early: the window closes now.
        closing.abort();
        Some(CpuReading::now(server_pid, &completed))
    };
    // The window never opened when the run ended first (it cannot: measuring starts
    // after the warm-up, and the run lasts past it), then there is no figure.
    let opening = if opening.is_finished() {
        opening.await.ok()
    } else {
        opening.abort();
        None
    };
    let r = recorder.lock().unwrap_or_else(|p| p.into_inner());
    let duration_s = if ran_whole_window {
        window.duration.as_secs_f64()
    } else {
        (r.last_done.max(measure_from) - measure_from).as_secs_f64()
    };
    report(
        mode.label(),
        &target,
        &r,
        throughput(&r, ran_whole_window),
        duration_s,
        opening.zip(closing),
    )
}

/// One point's report from its recorder, its throughput and its window's CPU readings.
fn report(
    point: String,
    target: &LoadTarget,
    r: &Recorder,
    throughput_rps: f64,
    duration_s: f64,
    readings: Option<(CpuReading, CpuReading)>,
) -> PointReport {
    let per_request = |of: fn(&CpuReading) -> Option<Duration>| {
        let (opening, closing) = readings?;
        cpu::ms_per(
            of(&opening),
            of(&closing),
            closing.completed - opening.completed,
        )
    };
    let server_stages_ms = r
        .stages_ms
        .iter()
        .map(|(k, v)| (k.clone(), median(&mut v.clone())))
        .collect();
    let late = |o: &Outcomes| target.late_after.map(|_| o.late);
    let by_input = target
        .input_names
        .iter()
        .zip(&r.by_input)
        .map(|(name, o)| InputReport {
            input: name.clone(),
            requests: o.requests,
            ok: o.ok,
            late: late(o),
            latency_ms: Percentiles::from_us(&o.latency_us),
            errors: o.errors.clone(),
        })
        .collect();
    PointReport {
        point,
        requests: r.all.requests,
        ok: r.all.ok,
        late: late(&r.all),
        duration_s,
        throughput_rps,
        latency_ms: Percentiles::from_us(&r.all.latency_us),
        errors: r.all.errors.clone(),
        by_input,
        server_stages_ms,
        server_cpu_ms_per_request: per_request(|c| c.server),
        client_cpu_ms_per_request: per_request(|c| c.client),
    }
}

/// One closed-loop client taking turns between servers, a request to each in order, so
/// that only one request is ever in flight and each server is loaded at concurrency 1
/// while the others idle. The servers' latencies are then seconds apart, not a whole
/// run: on a machine whose speed drifts by a fifth from minute to minute, that is what
/// makes their ratio mean something. Each server's report is a `c=1` point whose
/// throughput is its successes over the time spent waiting for its answers (alone, a
/// closed loop of one spends the whole window so), and whose CPU per request is its
/// process's over the requests it completed in the window (`server_pids`, in the order
/// of `targets`).
pub async fn run_turns(
    client: &reqwest::Client,
    targets: &[Arc<LoadTarget>],
    window: Window,
    server_pids: &[Option<u32>],
    progress: &ProgressBar,
) -> Vec<PointReport> {
    let start = Instant::now();
    let measure_from = start + window.warmup;
    let measure_until = measure_from + window.duration;
    let recorders: Vec<Mutex<Recorder>> = targets
        .iter()
        .map(|t| {
            Mutex::new(Recorder::new(
                measure_from..measure_until,
                t.input_names.len(),
            ))
        })
        .collect();
    let completed: Arc<Vec<AtomicU64>> =
        Arc::new(targets.iter().map(|_| AtomicU64::new(0)).collect());
    let readings = |pids: Vec<Option<u32>>| {
        let completed = completed.clone();
        move || -> Vec<CpuReading> {
            pids.iter()
                .zip(completed.iter())
                .map(|(&pid, done)| CpuReading::now(pid, done))
                .collect()
        }
    };
    let pids: Vec<Option<u32>> = (0..targets.len())
        .map(|i| server_pids.get(i).copied().flatten())
        .collect();
    let read = readings(pids);
    let mut opening = None;
    let mut measured_sent = 0u64;
    let mut turn = 0usize;
    loop {
        let now = Instant::now();
        if now >= measure_until {
            break;
        }
        let measured = now >= measure_from;
        if measured && opening.is_none() {
            opening = Some(read());
        }
        if measured {
            if window
                .max_requests
                .is_some_and(|max| measured_sent >= max * targets.len() as u64)
            {
                break;
            }
            measured_sent += 1;
        }
        let which = turn % targets.len();
        let index = turn / targets.len();
        one_request(client, &targets[which], index, measured, &recorders[which]).await;
        completed[which].fetch_add(1, Ordering::SeqCst);
        turn += 1;
        if turn.is_multiple_of(targets.len()) {
            progress.set_message(format!(
                "taking turns: {}, {} rounds",
                if measured { "measuring" } else { "warm-up" },
                turn / targets.len()
            ));
        }
    }
    let ran_whole_window = Instant::now() >= measure_until;
    let closing = opening.as_ref().map(|_| read());
    recorders
        .iter()
        .enumerate()
        .map(|(i, recorder)| {
            let r = recorder.lock().unwrap_or_else(|p| p.into_inner());
            let throughput = if r.busy.is_zero() {
                0.0
            } else {
                r.all.ok as f64 / r.busy.as_secs_f64()
            };
            let duration_s = if ran_whole_window {
                window.duration.as_secs_f64()
            } else {
                (r.last_done.max(measure_from) - measure_from).as_secs_f64()
            };
            let cpu = opening
                .as_ref()
                .zip(closing.as_ref())
                .map(|(o, c)| (o[i], c[i]));
            report(
                LoadMode::Closed { concurrency: 1 }.label(),
                &targets[i],
                &r,
                throughput,
                duration_s,
                cpu,
            )
        })
        .collect()
}

/// Sends one request and records its answer; a refusal's `Retry-After`, if it had one.
async fn one_request(
    client: &reqwest::Client,
    target: &LoadTarget,
    index: usize,
    measured: bool,
    recorder: &Mutex<Recorder>,
) -> Option<Duration> {
    let payload = &target.inputs[index % target.inputs.len()];
    let client = target.client.as_ref().unwrap_or(client);
    let grpc = payload.content_type == GRPC;
    let mut request = client
        .post(&target.url)
        .header(reqwest::header::CONTENT_TYPE, payload.content_type)
        .body(payload.body.clone());
    if let Some(n) = payload.inference_header {
        request = request.header("Inference-Header-Content-Length", n);
    }
    if grpc {
        request = request.header("te", "trailers");
    }
    if let Some(accept) = &target.accept {
        request = request.header(reqwest::header::ACCEPT, accept);
    }
    if let Some(attrs) = &target.custom_attributes {
        request = request.header("X-Amzn-SageMaker-Custom-Attributes", attrs);
    }
    let started = Instant::now();
    let mut retry_after = None;
    let outcome = match request.send().await {
        Ok(response) => {
            let status = response.status();
            if !status.is_success() {
                retry_after = response
                    .headers()
                    .get(reqwest::header::RETRY_AFTER)
                    .and_then(|v| v.to_str().ok()?.trim().parse::<u64>().ok())
                    .map(Duration::from_secs);
            }
            // A refused gRPC call answers with its status in the head (trailers only); an
            // answered one with a message, its status in the trailers.
            let grpc_status = response
                .headers()
                .get("grpc-status")
                .and_then(|v| v.to_str().ok())
                .map(str::to_string);
            let timing = response
                .headers()
                .get("server-timing")
                .and_then(|v| v.to_str().ok())
                .map(parse_server_timing);
            // The latency includes reading the whole body.
            match response.bytes().await {
                Ok(_) if grpc && grpc_status.as_deref().is_some_and(|s| s != "0") => {
                    Err(format!("grpc {}", grpc_status.unwrap_or_default()))
                }
                Ok(body) if grpc && body.len() < 5 => Err("grpc: no message".to_string()),
                Ok(_) if status.is_success() => Ok(timing),
                Ok(body) => Err(refusal(status, &body)),
                Err(_) => Err("transport".to_string()),
            }
        }
        Err(_) => Err("transport".to_string()),
    };
    let elapsed_us = started.elapsed().as_micros() as u64;
    let mut r = recorder.lock().unwrap_or_else(|p| p.into_inner());
    r.answered(Instant::now(), outcome.is_ok());
    if !measured {
        return retry_after;
    }
    r.busy += Duration::from_micros(elapsed_us);
    r.last_done = r.last_done.max(Instant::now());
    let recorded = match &outcome {
        Ok(_) => Ok(elapsed_us),
        Err(kind) => Err(kind.as_str()),
    };
    r.all.record(recorded, target.late_after);
    if let Some(input) = r.by_input.get_mut(payload.input) {
        input.record(recorded, target.late_after);
    }
    if let Ok(timing) = outcome {
        for (stage, ms) in timing.unwrap_or_default() {
            r.stages_ms.entry(stage).or_default().push(ms);
        }
    }
    retry_after
}

/// What a refusal is counted as: its status, and the `code` of a JSON error body
/// (`503 deadline_unreachable`), which says which of the server's refusals it was.
fn refusal(status: reqwest::StatusCode, body: &[u8]) -> String {
    let code = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("code")?.as_str().map(str::to_string));
    match code {
        Some(code) => format!("{} {code}", status.as_u16()),
        None => status.as_u16().to_string(),
    }
}

/// `name;dur=1.5, other;desc="x";dur=2` -> `[(name, 1.5), (other, 2.0)]` (ms).
pub fn parse_server_timing(header: &str) -> Vec<(String, f64)> {
    header
        .split(',')
        .filter_map(|metric| {
            let mut parts = metric.split(';').map(str::trim);
            let name = parts.next()?.to_string();
            let dur = parts.find_map(|p| p.strip_prefix("dur="))?.parse().ok()?;
            Some((name, dur))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A recorder over a 10 s window with `answers` (seconds from the window's start,
    /// success), `measured_ok` successes among the requests sent in it, the last of
    /// those answered at `last_done_s`.
    fn recorder_with(answers: &[(f64, bool)], measured_ok: u64, last_done_s: f64) -> Recorder {
        // Instants before the window's start: it opens 5 s after now.
        let now = Instant::now();
        let at = |s: f64| now + Duration::from_secs_f64(5.0 + s);
        let mut r = Recorder::new(at(0.0)..at(10.0), 1);
        for &(s, ok) in answers {
            r.answered(at(s), ok);
        }
        r.all.ok = measured_ok;
        r.last_done = at(last_done_s);
        r
    }

    #[test]
    fn throughput_counts_the_successes_that_arrive_in_the_window() {
        // One answer a second from -1.5 s to 11.5 s: 10 of them inside [0, 10), one a
        // failure, the ones before and after outside.
        let answers: Vec<(f64, bool)> = (0..14).map(|k| (k as f64 - 1.5, k != 5)).collect();
        // The requests sent in the window (10 succeeded) had their last answer at 11.5 s:
        // that way reads 10 / 11.5.
        let r = recorder_with(&answers, 10, 11.5);
        assert_eq!(r.ok_in_window, 9);
        assert!((throughput(&r, true) - 0.9).abs() < 1e-9);
        // Stopped early by a request count: the measured ones to their last answer.
        assert!((throughput(&r, false) - 10.0 / 11.5).abs() < 1e-9);
    }

    #[test]
    fn throughput_of_nothing_is_zero() {
        let r = recorder_with(&[], 0, 0.0);
        assert_eq!(throughput(&r, true), 0.0);
        assert_eq!(throughput(&r, false), 0.0);
    }

    #[test]
    fn server_timing_parses_names_and_durations() {
        assert_eq!(
            parse_server_timing("queue;dur=1.5, model;desc=\"u2netp\";dur=120, bad"),
            vec![("queue".to_string(), 1.5), ("model".to_string(), 120.0)]
        );
    }
}

/// Serves `app` on a port of its own; its `/invocations` URL.
#[cfg(test)]
async fn listen(app: axum::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/invocations", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await });
    url
}

/// `run_turns` against two small servers over real sockets, each recording how many of
/// the two had a request in flight whenever one arrived.
#[cfg(test)]
mod turns_tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[derive(Default)]
    struct Counts {
        in_flight: AtomicUsize,
        most_in_flight: AtomicUsize,
        served: [AtomicU64; 2],
    }

    async fn serve(which: usize, delay: Duration, counts: Arc<Counts>) -> String {
        let app = axum::Router::new().route(
            "/invocations",
            axum::routing::post(move || {
                let counts = counts.clone();
                async move {
                    let now = counts.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                    counts.most_in_flight.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(delay).await;
                    counts.served[which].fetch_add(1, Ordering::SeqCst);
                    counts.in_flight.fetch_sub(1, Ordering::SeqCst);
                    "ok"
                }
            }),
        );
        listen(app).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_request_in_flight_and_each_server_its_turn() {
        let counts = Arc::new(Counts::default());
        let (fast, slow) = (Duration::from_millis(20), Duration::from_millis(60));
        let urls = [
            serve(0, fast, counts.clone()).await,
            serve(1, slow, counts.clone()).await,
        ];
        let targets: Vec<Arc<LoadTarget>> = urls
            .iter()
            .map(|url| {
                Arc::new(LoadTarget {
                    url: url.clone(),
                    inputs: vec![Payload::invocations((
                        Bytes::from_static(b"x"),
                        "image/jpeg",
                    ))],
                    input_names: vec!["x".into()],
                    late_after: None,
                    honor_retry_after: false,
                    accept: None,
                    custom_attributes: None,
                    client: None,
                })
            })
            .collect();
        let window = Window {
            warmup: Duration::from_millis(200),
            duration: Duration::from_secs(1),
            max_requests: None,
        };
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let points = run_turns(
            &client,
            &targets,
            window,
            &[None, None],
            &ProgressBar::hidden(),
        )
        .await;

        assert_eq!(counts.most_in_flight.load(Ordering::SeqCst), 1);
        let served = counts.served.each_ref().map(|n| n.load(Ordering::SeqCst));
        assert!(served[0].abs_diff(served[1]) <= 1, "{served:?}");
        assert_eq!(points.len(), 2);
        for (point, delay) in points.iter().zip([fast, slow]) {
            assert_eq!(point.point, "c=1");
            assert!(point.ok > 0 && point.ok == point.requests, "{point:?}");
            assert!(point.requests.abs_diff(points[0].requests) <= 1);
            // Each server's rate is over the time spent on its own answers: at most one
            // per delay, and more than its answers over the whole window, most of which
            // went to the other's.
            assert!(
                point.throughput_rps <= 1.0 / delay.as_secs_f64(),
                "{point:?}"
            );
            assert!(
                point.throughput_rps > point.ok as f64 / point.duration_s,
                "{point:?}"
            );
            assert!(
                point.latency_ms.p50 >= delay.as_secs_f64() * 1e3,
                "{point:?}"
            );
        }
    }
}

/// `run_point` with several inputs against a small server over real sockets: each input's
/// requests, latencies, late answers and refusals apart.
#[cfg(test)]
mod mixed_tests {
    use super::*;

    /// Answers `small` at once, `large` after `slow`, and refuses `refused` as celer
    /// refuses a request it cannot finish in time.
    async fn serve(slow: Duration) -> String {
        use axum::http::StatusCode;
        let app = axum::Router::new().route(
            "/invocations",
            axum::routing::post(move |body: Bytes| async move {
                match &body[..] {
                    b"large" => {
                        tokio::time::sleep(slow).await;
                        (StatusCode::OK, "ok".to_string())
                    }
                    b"refused" => (
                        StatusCode::SERVICE_UNAVAILABLE,
                        r#"{"error": "too late", "code": "deadline_unreachable"}"#.to_string(),
                    ),
                    _ => (StatusCode::OK, "ok".to_string()),
                }
            }),
        );
        listen(app).await
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn each_input_is_sent_in_turn_and_reported_apart() {
        let slow = Duration::from_millis(60);
        let names = ["small", "large", "refused"];
        let target = Arc::new(LoadTarget {
            url: serve(slow).await,
            inputs: names
                .iter()
                .enumerate()
                .map(|(i, name)| {
                    Payload::invocations((Bytes::from_static(name.as_bytes()), "image/jpeg"))
                        .of_input(i)
                })
                .collect(),
            input_names: names.iter().map(|n| n.to_string()).collect(),
            late_after: Some(slow / 2),
            honor_retry_after: false,
            accept: None,
            custom_attributes: None,
            client: None,
        });
        let window = Window {
            warmup: Duration::ZERO,
            duration: Duration::from_millis(800),
            max_requests: None,
        };
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let mode = LoadMode::Closed { concurrency: 3 };
        let point = run_point(&client, target, mode, window, None, &ProgressBar::hidden()).await;

        assert_eq!(point.by_input.len(), 3, "{point:?}");
        let [small, large, refused] = &point.by_input[..] else {
            unreachable!()
        };
        assert_eq!(
            [&small.input, &large.input, &refused.input],
            names.map(String::from).each_ref()
        );
        // One sequence over the clients: the inputs are sent in turn, whichever client is
        // free, so each is sent as often as the others (give or take those in flight).
        for input in [small, large] {
            assert!(input.requests.abs_diff(refused.requests) <= 3, "{point:?}");
        }
        assert!(large.requests > 0, "{point:?}");
        // A large one always takes longer than the deadline; the point adds up its inputs.
        assert_eq!(large.late, Some(large.ok), "{point:?}");
        assert!(
            large.latency_ms.p50 >= slow.as_secs_f64() * 1e3,
            "{point:?}"
        );
        assert_eq!(
            point.late,
            Some(small.late.unwrap_or(0) + large.ok),
            "{point:?}"
        );
        assert_eq!(
            point.requests,
            small.requests + large.requests + refused.requests
        );
        // A refusal is counted by its status and the code of its JSON body.
        assert_eq!(refused.ok, 0, "{point:?}");
        assert_eq!(
            refused.errors,
            BTreeMap::from([("503 deadline_unreachable".to_string(), refused.requests)])
        );
        assert_eq!(point.errors, refused.errors);
        assert!(
            small.errors.is_empty() && large.errors.is_empty(),
            "{point:?}"
        );
    }
}

/// A closed-loop client and a server that refuses every request with `Retry-After: 1`.
#[cfg(test)]
mod retry_after_tests {
    use super::*;

    async fn refusing() -> String {
        use axum::http::{header, StatusCode};
        let app = axum::Router::new().route(
            "/invocations",
            axum::routing::post(|| async {
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    [(header::RETRY_AFTER, "1")],
                    r#"{"error": "at capacity", "code": "overloaded"}"#,
                )
            }),
        );
        listen(app).await
    }

    async fn requests_sent(honor_retry_after: bool) -> u64 {
        let target = Arc::new(LoadTarget {
            url: refusing().await,
            inputs: vec![Payload::invocations((
                Bytes::from_static(b"x"),
                "image/jpeg",
            ))],
            input_names: vec!["x".to_string()],
            late_after: None,
            honor_retry_after,
            accept: None,
            custom_attributes: None,
            client: None,
        });
        let window = Window {
            warmup: Duration::ZERO,
            duration: Duration::from_millis(1500),
            max_requests: None,
        };
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let mode = LoadMode::Closed { concurrency: 1 };
        let point = run_point(&client, target, mode, window, None, &ProgressBar::hidden()).await;
        assert_eq!(point.ok, 0, "{point:?}");
        assert_eq!(
            point.errors,
            BTreeMap::from([("503 overloaded".to_string(), point.requests)])
        );
        point.requests
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_client_honoring_retry_after_waits_it_out_and_one_not_does_not() {
        // Waiting a second after each refusal, one client sends at most two requests
        // in the 1.5 s window; sending the next at once, many more.
        assert!(requests_sent(true).await <= 2);
        assert!(requests_sent(false).await > 10);
    }
}

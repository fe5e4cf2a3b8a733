//! SageMaker's hosting modes against `celer serve` over sockets: a batch transform agent
//! (asks `/execution-parameters`, then sends a folder of images with that concurrency,
//! one image per request, and checks every answer), the limits each mode sets, the
//! response limit on a 12 MP photo, `/ping` while no device can serve, and the process's
//! malloc settings.

mod common;
mod serve_support;

use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use celer::codec::decode::{self, DecodeLimits};
use celer::http::{routes, AppState, FrontEnd};
use celer::replica::{BoxedMatteExecutor, MatteJob, MatteOutput};
use celer::sched::{DeviceSetup, ExecError, Executor, Scheduler, SchedulerConfig};
use celer::spec::OutputKind;
use common::{app_state, fetched, fixture_dir, gradient_png, model_dir, StateOptions};
use http_body_util::BodyExt;
use serve_support::{Answer, Body as Sent, Server};
use tower::ServiceExt;

const MIB: usize = 1024 * 1024;

// ---- batch transform ----

/// A job's input folder: the test photos, and a BMP over real-time's 6 MiB.
fn job_folder() -> (tempfile::TempDir, Vec<PathBuf>) {
    let dir = tempfile::tempdir().unwrap();
    let mut files = Vec::new();
    for name in [
        "astronaut.png",
        "astronaut.jpg",
        "chelsea.png",
        "chelsea-exif6.jpg",
        "photo-320x320.jpg",
        "photo-1920x1080.jpg",
    ] {
        let to = dir.path().join(name);
        std::fs::copy(fetched(name), &to).unwrap();
        files.push(to);
    }
    let photo = image::open(fetched("photo-1920x1080.jpg")).unwrap();
    let big = photo.resize_exact(2048, 1152, image::imageops::FilterType::Triangle);
    let bmp = dir.path().join("photo-2048x1152.bmp");
    big.to_rgb8().save(&bmp).unwrap();
    assert!(std::fs::metadata(&bmp).unwrap().len() > 6 * MIB as u64);
    files.push(bmp);
    (dir, files)
}

/// What the transform agent got back for one file.
struct Record {
    file: PathBuf,
    answer: Answer,
}

/// The transform agent as documented: every file of the folder as one request
/// (`SplitType` None), `concurrency` at a time, with the job's `ContentType` and
/// `Accept`; `chunked` sends each body with chunked transfer encoding (`MaxPayloadInMB`
/// 0). Returns the records and the most requests it had outstanding at once.
fn transform(
    server: &Server,
    files: &[PathBuf],
    concurrency: usize,
    chunked: bool,
) -> (Vec<Record>, usize) {
    let queue = Mutex::new(files.to_vec());
    let outstanding = AtomicUsize::new(0);
    let most = AtomicUsize::new(0);
    let start = std::sync::Barrier::new(concurrency);
    let records = Mutex::new(Vec::new());
    std::thread::scope(|scope| {
        for _ in 0..concurrency {
            scope.spawn(|| {
                // Every worker starts together, as the agent's do.
                start.wait();
                loop {
                    let Some(file) = queue.lock().unwrap().pop() else {
                        return;
                    };
                    let bytes = std::fs::read(&file).unwrap();
                    let body = if chunked {
                        Sent::Chunked(&bytes, 256 * 1024)
                    } else {
                        Sent::Whole(&bytes)
                    };
                    let now = outstanding.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    let answer = server.request(
                        "POST",
                        "/invocations",
                        &[
                            ("Content-Type", "application/x-image"),
                            ("Accept", "image/png"),
                        ],
                        Some(body),
                    );
                    outstanding.fetch_sub(1, Ordering::SeqCst);
                    records.lock().unwrap().push(Record { file, answer });
                }
            });
        }
    });
    (records.into_inner().unwrap(), most.load(Ordering::SeqCst))
}

/// Every record is a 200 RGBA PNG of its file's upright size, with no colour under
/// transparent pixels, byte for byte the answer a lone request gets.
fn check_records(server: &Server, records: &[Record], expected: usize) {
    assert_eq!(records.len(), expected, "one answer per file");
    let mut alone = std::collections::HashMap::new();
    for r in records {
        let name = r.file.file_name().unwrap().to_string_lossy().to_string();
        let a = &r.answer;
        assert_eq!(
            a.status,
            200,
            "{name}: {}\n{}",
            String::from_utf8_lossy(&a.body),
            server.log()
        );
        assert_eq!(a.header("content-type"), Some("image/png"), "{name}");
        let source = std::fs::read(&r.file).unwrap();
        let upright = decode::decode(&source, &DecodeLimits::default()).unwrap();
        let cutout = image::load_from_memory(&a.body).unwrap();
        assert_eq!(cutout.color(), image::ColorType::Rgba8, "{name}");
        let cutout = cutout.into_rgba8();
        assert_eq!(cutout.dimensions(), upright.dimensions(), "{name}");
        let mut shown = 0usize;
        for p in cutout.pixels() {
            if p[3] == 0 {
                assert_eq!(
                    p.0,
                    [0, 0, 0, 0],
                    "{name}: colour under a transparent pixel"
                );
            } else {
                shown += 1;
            }
        }
        assert!(shown > 0, "{name}: nothing cut out");
        let lone = alone.entry(name.clone()).or_insert_with(|| {
            let lone = server.post(
                "/invocations",
                &[("Content-Type", "application/x-image")],
                &source,
            );
            assert_eq!(lone.status, 200, "{name}");
            lone.body
        });
        assert!(
            *lone == a.body,
            "{name}: differs from a lone request's answer"
        );
    }
}

#[test]
fn batch_transform_job_with_the_concurrency_of_execution_parameters() {
    let (_dir, files) = job_folder();
    // A job that sets its payload limit (20 MB) and leaves the concurrency to the
    // container.
    let server = Server::start(
        &model_dir("u2netp"),
        std::iter::empty::<&str>(),
        &[
            ("SAGEMAKER_BATCH", "true"),
            ("SAGEMAKER_MAX_PAYLOAD_IN_MB", "20"),
            ("SAGEMAKER_BATCH_STRATEGY", "SINGLE_RECORD"),
        ],
    );
    assert!(
        server
            .log()
            .contains("hosting batch: bodies up to 20971520 bytes"),
        "{}",
        server.log()
    );
    let params = server.get_json("/execution-parameters");
    assert_eq!(params["BatchStrategy"], "SINGLE_RECORD", "{params}");
    assert_eq!(params["MaxPayloadInMB"], 20, "{params}");
    let concurrency = params["MaxConcurrentTransforms"].as_u64().unwrap() as usize;
    // Two per replica of the CPU, as many as the server says it started.
    assert_eq!(concurrency, 2 * replicas_in(&server.log()), "{params}");

    let (records, most) = transform(&server, &files, concurrency, false);
    check_records(&server, &records, files.len());
    assert_eq!(
        most, concurrency,
        "the agent kept {concurrency} requests outstanding"
    );
    assert!(server.stop().success());
}

#[test]
fn batch_transform_job_with_its_own_concurrency_and_chunked_bodies() {
    let (_dir, files) = job_folder();
    // The job sets 24 at once, over the default queue of 16, and MaxPayloadInMB 0:
    // bodies come chunked, of any size.
    let server = Server::start(
        &model_dir("u2netp"),
        std::iter::empty::<&str>(),
        &[
            ("SAGEMAKER_BATCH", "true"),
            ("SAGEMAKER_MAX_PAYLOAD_IN_MB", "0"),
            ("SAGEMAKER_MAX_CONCURRENT_TRANSFORMS", "24"),
        ],
    );
    let params = server.get_json("/execution-parameters");
    assert_eq!(params["MaxConcurrentTransforms"], 24, "{params}");
    assert_eq!(params["MaxPayloadInMB"], 0, "{params}");
    let many: Vec<PathBuf> = (0..4).flat_map(|_| files.iter().cloned()).collect();
    let (records, most) = transform(&server, &many, 24, true);
    check_records(&server, &records, many.len());
    assert_eq!(most, 24);
    assert!(server.stop().success());
}

/// The CPU replicas `celer serve` says it started (`replicas=N` in its log).
fn replicas_in(log: &str) -> usize {
    log.split("replicas=")
        .nth(1)
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no replicas=N in\n{log}"))
}

// ---- each mode's limits ----

/// One mode's case: its name, environment, body limit, response limit as logged,
/// deadline (s) and `MaxPayloadInMB`.
type ModeCase<'a> = (&'a str, &'a [(&'a str, &'a str)], usize, &'a str, u64, u64);

/// The body limit a server states when refusing a declared `Content-Length` over it.
fn body_limit(server: &Server) -> usize {
    let (status, body) = server.raw(
        "POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n\
         Content-Length: 1099511627776\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(status, 413, "{}", String::from_utf8_lossy(&body));
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["code"], "payload_too_large");
    let message = json["error"].as_str().unwrap();
    message
        .split("limit of ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no limit in {message}"))
}

/// Declares one byte over `limit`: refused from the header alone.
fn refuses_one_over(server: &Server, limit: usize) {
    let (status, _) = server.raw(&format!(
        "POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: image/jpeg\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        limit + 1
    ));
    assert_eq!(status, 413);
}

#[test]
fn each_hosting_mode_sets_its_limits() {
    let fixture = fixture_dir("prob-guided");
    let cases: [ModeCase; 4] = [
        ("realtime", &[], 6 * MIB, "up to 6000000 bytes", 60, 6),
        ("serverless", &[], 4 * MIB, "up to 4000000 bytes", 60, 4),
        ("async", &[], 400_000_000 + MIB, "unlimited", 3600, 100),
        (
            "batch",
            &[("SAGEMAKER_MAX_PAYLOAD_IN_MB", "50")],
            50 * MIB,
            "unlimited",
            3600,
            50,
        ),
    ];
    for (mode, env, body, response, deadline, payload_mb) in cases {
        let server = Server::start(&fixture, ["--hosting", mode], env);
        let log = server.log();
        let line = format!(
            "hosting {mode}: bodies up to {body} bytes, responses {response}, deadline {deadline} s"
        );
        assert!(log.contains(&line), "{mode}: no `{line}` in\n{log}");
        assert_eq!(body_limit(&server), body, "{mode}");
        refuses_one_over(&server, body);
        let params = server.get_json("/execution-parameters");
        assert_eq!(params["MaxPayloadInMB"], payload_mb, "{mode}: {params}");
        if mode == "serverless" {
            // One replica: two at once.
            assert_eq!(params["MaxConcurrentTransforms"], 2, "{params}");
            assert_eq!(replicas_in(&log), 1, "{log}");
        }
        assert!(server.stop().success(), "{mode}");
    }
    // SAGEMAKER_BATCH=true alone picks batch.
    let server = Server::start(
        &fixture,
        std::iter::empty::<&str>(),
        &[("SAGEMAKER_BATCH", "true")],
    );
    assert!(
        server
            .log()
            .contains("hosting batch: bodies up to 6291456 bytes"),
        "{}",
        server.log()
    );
    drop(server);
}

#[test]
fn explicit_settings_win_over_the_mode_and_the_response_limit_refuses() {
    let server = Server::start(
        &fixture_dir("prob-guided"),
        [
            "--hosting",
            "serverless",
            "--max-body-bytes",
            "100000",
            "--max-response-bytes",
            "700",
            "--deadline-s",
            "7",
            "--replicas",
            "2",
        ],
        &[],
    );
    let log = server.log();
    assert!(
        log.contains("hosting serverless: bodies up to 100000 bytes, responses up to 700 bytes, deadline 7 s"),
        "{log}"
    );
    assert!(log.contains("replicas=2"), "{log}");
    assert_eq!(body_limit(&server), 100_000);
    // This 64x48 image's cut-out is about 960 bytes as PNG, its alpha about 510.
    let png = common::png_bytes(&common::bright_rectangle(64, 48));
    let a = server.post("/invocations", &[("Content-Type", "image/png")], &png);
    assert_eq!(a.status, 413, "{}", String::from_utf8_lossy(&a.body));
    let json = a.json();
    assert_eq!(json["code"], "response_too_large", "{json}");
    let message = json["error"].as_str().unwrap();
    assert!(
        message.contains("limit of 700 bytes") && message.contains("output=alpha"),
        "{message}"
    );
    // The mask alone fits, and the server is still up.
    let a = server.post(
        "/invocations",
        &[
            ("Content-Type", "image/png"),
            ("X-Amzn-SageMaker-Custom-Attributes", "output=alpha"),
        ],
        &png,
    );
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    assert!(a.body.len() <= 700);
    assert!(server.stop().success());
}

// ---- the response limit on a 12 MP photo ----

async fn send(app: &axum::Router, request: Request<Body>) -> (StatusCode, String, Vec<u8>) {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let content_type = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_string();
    let body = response
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes()
        .to_vec();
    (status, content_type, body)
}

fn photo_request(jpeg: &[u8], headers: &[(&str, &str)]) -> Request<Body> {
    let mut r = Request::post("/invocations").header(header::CONTENT_TYPE, "image/jpeg");
    for (k, v) in headers {
        r = r.header(*k, *v);
    }
    r.body(Body::from(jpeg.to_vec())).unwrap()
}

#[tokio::test]
async fn a_12_mp_photo_on_real_time_settings_fits_or_is_refused_clearly() {
    // The state `celer serve` builds on real-time settings (the default mode).
    let state = app_state(&model_dir("u2netp"), StateOptions::default());
    assert_eq!(state.hosting.max_response_bytes, Some(6_000_000));
    let app = routes(Arc::new(state));
    let jpeg = std::fs::read(fetched("photo-4032x3024.jpg")).unwrap();
    for (what, headers) in [
        ("the default answer", &[][..]),
        ("WebP", &[("accept", "image/webp")][..]),
    ] {
        let (status, content_type, body) = send(&app, photo_request(&jpeg, headers)).await;
        match status {
            StatusCode::OK => {
                assert!(body.len() <= 6_000_000, "{what}: {} bytes", body.len());
                let image = image::load_from_memory(&body).unwrap();
                assert_eq!(image.color(), image::ColorType::Rgba8, "{what}");
                assert_eq!((image.width(), image.height()), (4032, 3024), "{what}");
                eprintln!("{what}: {content_type}, {} bytes: fits", body.len());
            }
            StatusCode::PAYLOAD_TOO_LARGE => {
                let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
                assert_eq!(json["code"], "response_too_large", "{what}: {json}");
                let message = json["error"].as_str().unwrap();
                for hint in [
                    "output=alpha",
                    "smaller image",
                    "CELER_HOSTING=async",
                    "6000000",
                ] {
                    assert!(message.contains(hint), "{what}: {hint}: {message}");
                }
                eprintln!("{what}: refused: {message}");
            }
            other => panic!("{what}: {other}: {}", String::from_utf8_lossy(&body)),
        }
    }
    // The mask alone always fits.
    let (status, content_type, body) = send(
        &app,
        photo_request(
            &jpeg,
            &[("x-amzn-sagemaker-custom-attributes", "output=alpha")],
        ),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(content_type, "image/png");
    assert!(body.len() < 6_000_000, "{}", body.len());
    eprintln!("alpha: {} bytes", body.len());
}

// ---- /ping while no device can serve ----

/// A device that fails while `broken` is set, runs and health checks alike.
struct Breakable(Arc<std::sync::atomic::AtomicBool>);

impl Executor for Breakable {
    type Input = MatteJob;
    type Output = MatteOutput;

    fn run_batch(&mut self, inputs: &[&MatteJob]) -> Result<Vec<MatteOutput>, ExecError> {
        self.health_check()?;
        Ok(inputs
            .iter()
            .map(|job| common::opaque_output(job))
            .collect())
    }

    fn health_check(&mut self) -> Result<(), ExecError> {
        if self.0.load(Ordering::SeqCst) {
            Err("the device is broken".into())
        } else {
            Ok(())
        }
    }
}

#[tokio::test]
async fn ping_fails_while_no_device_can_serve_and_recovers_with_it() {
    let broken = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = broken.clone();
    let device: DeviceSetup<BoxedMatteExecutor> = DeviceSetup {
        name: "breakable".into(),
        replicas: 1,
        batching: Default::default(),
        load: Arc::new(move |_| Ok(Box::new(Breakable(flag.clone())) as BoxedMatteExecutor)),
        interim: false,
    };
    let router = Scheduler::start(
        vec![device],
        SchedulerConfig {
            unhealthy_after_failures: 1,
            health_check_interval: Duration::from_millis(20),
            ..SchedulerConfig::default()
        },
    );
    router.wait_ready().unwrap();
    let state = AppState::new(
        router,
        FrontEnd::new(StateOptions::default().limits, OutputKind::Alpha),
    );
    let app = routes(Arc::new(state));
    let ping = || async { send(&app, Request::get("/ping").body(Body::empty()).unwrap()).await };
    assert_eq!(ping().await.0, StatusCode::OK);

    broken.store(true, Ordering::SeqCst);
    let png = common::png_bytes(&common::bright_rectangle(64, 48));
    let (status, _, _) = send(
        &app,
        Request::post("/invocations")
            .header(header::CONTENT_TYPE, "image/png")
            .body(Body::from(png.clone()))
            .unwrap(),
    )
    .await;
    assert!(status.is_server_error(), "{status}");
    let (status, _, body) = ping().await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
    let json: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(json["status"], "unhealthy", "{json}");

    // Fixed: the next health check returns the device, and /ping with it.
    broken.store(false, Ordering::SeqCst);
    let started = std::time::Instant::now();
    while ping().await.0 != StatusCode::OK {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "/ping stayed 503"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (status, _, _) = send(
        &app,
        Request::post("/invocations")
            .header(header::CONTENT_TYPE, "image/png")
            .body(Body::from(png))
            .unwrap(),
    )
    .await;
    assert_eq!(status, StatusCode::OK);
}

// ---- the process ----

/// Process `pid`'s environment as exec gave it, one entry a line. glibc 2.36 cuts
/// `GLIBC_TUNABLES` at its colons in place, so its later tunables read as lines of their
/// own.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn environ_of(pid: u32) -> String {
    let environ = std::fs::read(format!("/proc/{pid}/environ")).expect("readable environ");
    String::from_utf8_lossy(&environ).replace('\0', "\n")
}

/// `celer serve` runs with glibc's transparent huge pages for malloc and mimalloc's purge
/// delay at 10 minutes (it re-executes itself with them, src/main.rs), keeps a caller's other
/// tunables, and leaves an explicit `glibc.malloc.hugetlb=0` or purge delay alone; each
/// then serves a photo.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn serve_runs_with_its_allocator_settings_unless_told_not_to() {
    let fixture = fixture_dir("prob-guided");
    let jpeg = common::jpeg_bytes(&common::bright_rectangle(96, 64), 90);
    // (GLIBC_TUNABLES given, MIMALLOC_PURGE_DELAY given, lines wanted, a line not wanted)
    type Case<'a> = (Option<&'a str>, Option<&'a str>, &'a [&'a str], &'a str);
    let cases: [Case; 4] = [
        (
            None,
            None,
            &[
                "GLIBC_TUNABLES=glibc.malloc.hugetlb=1",
                "MIMALLOC_PURGE_DELAY=600000",
            ],
            "-",
        ),
        (
            Some("glibc.malloc.tcache_count=7"),
            None,
            &[
                "GLIBC_TUNABLES=glibc.malloc.tcache_count=7",
                "glibc.malloc.hugetlb=1",
                "MIMALLOC_PURGE_DELAY=600000",
            ],
            "-",
        ),
        (
            Some("glibc.malloc.hugetlb=0"),
            None,
            &[
                "GLIBC_TUNABLES=glibc.malloc.hugetlb=0",
                "MIMALLOC_PURGE_DELAY=600000",
            ],
            "glibc.malloc.hugetlb=1",
        ),
        // Both set: nothing to add, so no second exec.
        (
            Some("glibc.malloc.hugetlb=0"),
            Some("250"),
            &[
                "GLIBC_TUNABLES=glibc.malloc.hugetlb=0",
                "MIMALLOC_PURGE_DELAY=250",
            ],
            "CELER_GLIBC_TUNED=1",
        ),
    ];
    for (given, purge, want, not_want) in cases {
        let mut command = Server::command(&fixture, ["--replicas", "1"], &[]);
        command.env_remove("CELER_GLIBC_TUNED");
        match given {
            Some(value) => command.env("GLIBC_TUNABLES", value),
            None => command.env_remove("GLIBC_TUNABLES"),
        };
        match purge {
            Some(value) => command.env("MIMALLOC_PURGE_DELAY", value),
            None => command.env_remove("MIMALLOC_PURGE_DELAY"),
        };
        let server = Server::spawn(command, Duration::from_secs(60));
        let environ = environ_of(server.pid());
        let lines: Vec<&str> = environ.lines().collect();
        for line in want {
            assert!(
                lines.contains(line),
                "given {given:?}: no {line} in {lines:?}"
            );
        }
        assert!(!lines.contains(&not_want), "given {given:?}: {lines:?}");
        let answer = server.post("/invocations", &[("Content-Type", "image/jpeg")], &jpeg);
        assert_eq!(answer.status, 200, "given {given:?}: {}", server.log());
        assert!(
            !server.log().contains("running without glibc's huge pages"),
            "{}",
            server.log()
        );
    }
}

/// The server's resident memory, from /proc (kB); `None` once it has exited.
fn rss_kb(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|line| line.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// What a burst of large photos took stays with the server while it is busy (the pixel
/// blocks it keeps, mimalloc's pages kept 10 minutes), and goes back to the system once
/// it goes idle: most of the growth is gone within seconds of the last answer.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn an_idle_server_gives_back_the_memory_a_burst_of_large_photos_took() {
    // No queue budget: the burst waits as long as it must on cores other tests share.
    let server = Server::start(
        &fixture_dir("prob-guided"),
        ["--replicas", "2", "--max-queue-wait", "off"],
        &[],
    );
    // 1080p: 6.2 MB of pixels each, over the size from which blocks are kept.
    let photo = std::fs::read(fetched("photo-1920x1080.jpg")).expect("the fetched photo");
    let pid = server.pid();
    let rss = || rss_kb(pid).expect("the server's VmRSS");
    let before = rss();
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(before));
    let done = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let sampler = {
        let (peak, done) = (peak.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Relaxed) {
                peak.fetch_max(rss_kb(pid).unwrap_or(0), Ordering::Relaxed);
                std::thread::sleep(Duration::from_millis(20));
            }
        })
    };
    std::thread::scope(|s| {
        for _ in 0..4 {
            s.spawn(|| {
                for _ in 0..2 {
                    let answer = server.post(
                        "/invocations",
                        &[
                            ("Content-Type", "image/jpeg"),
                            ("X-Amzn-SageMaker-Custom-Attributes", "output=alpha"),
                        ],
                        &photo,
                    );
                    assert_eq!(
                        answer.status,
                        200,
                        "{}\n{}",
                        String::from_utf8_lossy(&answer.body),
                        server.log()
                    );
                }
            });
        }
    });
    done.store(true, Ordering::Relaxed);
    sampler.join().unwrap();
    let peak = peak.load(Ordering::Relaxed).max(rss());
    let grown = peak.saturating_sub(before);
    // Four photos at once, and each replica's buffers for them (about 440 MB measured).
    assert!(grown > 100_000, "grew only {grown} kB from {before} kB");
    // Idle 3 s, then given back: wait up to 20 s for half the growth to go (with the
    // purge delay alone, none of it went in that time).
    let target = before + grown / 2;
    let until = std::time::Instant::now() + Duration::from_secs(20);
    let mut now = rss();
    while now > target && std::time::Instant::now() < until {
        std::thread::sleep(Duration::from_millis(200));
        now = rss();
    }
    assert!(
        now <= target,
        "idle: {now} kB resident, against {before} kB before the burst and {peak} kB at its peak"
    );
}

/// `--warmup-size` on the CPU: each replica runs an image of the size at load, and the
/// device is priced from the timed run before its first request (`/metrics` shows the
/// cost model's price of a request's models); without it, nothing is priced until a
/// request has run.
#[test]
fn cpu_replicas_warm_up_at_load_and_are_priced_before_the_first_request() {
    let fixture = fixture_dir("prob-guided");
    let price = |server: &Server| -> f64 {
        let (status, body) = server.get("/metrics");
        assert_eq!(status, 200);
        let text = String::from_utf8_lossy(&body).into_owned();
        text.lines()
            .find_map(|line| line.strip_prefix("celer_device_cost_fixed_seconds{device=\"cpu\"} "))
            .unwrap_or_else(|| panic!("no price of the CPU in {text}"))
            .parse()
            .expect("a number")
    };
    let warmed = Server::spawn(
        Server::command(
            &fixture,
            ["--replicas", "2", "--warmup-size", "96x64,200x150"],
            &[],
        ),
        Duration::from_secs(60),
    );
    assert!(price(&warmed) > 0.0, "{}", warmed.log());
    let cold = Server::spawn(
        Server::command(&fixture, ["--replicas", "2"], &[]),
        Duration::from_secs(60),
    );
    assert_eq!(price(&cold), 0.0);
    let jpeg = common::jpeg_bytes(&common::bright_rectangle(96, 64), 90);
    let answer = cold.post("/invocations", &[("Content-Type", "image/jpeg")], &jpeg);
    assert_eq!(answer.status, 200, "{}", cold.log());
    assert!(price(&cold) > 0.0);
}

/// CloudWatch's view of a server: with `CELER_LOG_FORMAT=json` every log line is one JSON
/// object, and each request has an access line under its id: SageMaker's
/// `X-Amzn-SageMaker-Inference-Id` when sent, else one celer makes; either comes back in
/// `X-Request-Id`. An inference's line names its route, status, bytes, device and times.
#[test]
fn json_logs_carry_each_requests_id_in_its_access_line() {
    let server = Server::start(
        &model_dir("u2netp"),
        std::iter::empty::<&str>(),
        &[("CELER_LOG_FORMAT", "json")],
    );
    let png = gradient_png(64, 48);
    let named = server.post(
        "/invocations",
        &[
            ("content-type", "image/png"),
            ("x-amzn-sagemaker-inference-id", "inf-7f3a"),
        ],
        &png,
    );
    assert_eq!(named.status, 200);
    assert_eq!(named.header("x-request-id"), Some("inf-7f3a"));
    let anonymous = server.post("/invocations", &[("content-type", "image/png")], &png);
    assert_eq!(anonymous.status, 200);
    let made = anonymous
        .header("x-request-id")
        .expect("an id made")
        .to_string();
    assert!(
        made.len() == 32 && made.bytes().all(|b| b.is_ascii_hexdigit()),
        "{made}"
    );
    let refused = server.request("GET", "/nowhere", &[("x-request-id", "lost-1")], None);
    assert_eq!(
        (refused.status, refused.header("x-request-id")),
        (404, Some("lost-1"))
    );

    // The lines come through a pipe read by another thread: wait for the last one.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !server.log().contains("lost-1") && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let log = server.log();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let access = |id: &str| {
        lines
            .iter()
            .find(|l| l["target"] == "celer::access" && l["request_id"] == id)
            .unwrap_or_else(|| panic!("no access line for {id}:\n{log}"))
            .clone()
    };
    for id in ["inf-7f3a", made.as_str()] {
        let line = access(id);
        assert_eq!(line["level"], "INFO", "{line}");
        assert_eq!(line["method"], "POST", "{line}");
        assert_eq!(line["path"], "/invocations", "{line}");
        assert_eq!(line["status"], 200, "{line}");
        assert!(line["bytes"].as_u64().unwrap_or(0) > 0, "{line}");
        assert!(line["duration_ms"].as_f64().is_some(), "{line}");
        assert!(line["device"].is_string(), "{line}");
        assert!(line["queue_ms"].as_f64().is_some(), "{line}");
        assert!(line["compute_ms"].as_f64().is_some(), "{line}");
    }
    let lost = access("lost-1");
    assert_eq!(
        (lost["status"].clone(), lost["path"].clone()),
        (404.into(), "/nowhere".into())
    );
    assert!(lost["device"].is_null(), "{lost}");
    assert!(server.stop().success());
}

/// Kubernetes' stop: SIGTERM arrives while the endpoint is still routed here for a moment.
/// With `CELER_DRAIN_S` celer keeps answering in those seconds while its readiness answers
/// 503 (the load balancer's cue to stop sending), and liveness stays 200 (no restart);
/// then it closes the listener, finishes and exits 0.
#[test]
fn after_sigterm_a_drain_answers_requests_while_readiness_says_503() {
    let server = Server::start(
        &model_dir("u2netp"),
        std::iter::empty::<&str>(),
        &[("CELER_DRAIN_S", "5")],
    );
    let png = gradient_png(64, 48);
    assert_eq!(server.get("/ping").0, 200);
    assert_eq!(server.get("/v2/health/ready").0, 200);

    server.terminate();
    // Readiness turns once the signal is handled; the listener is still open.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let mut ping = server.get("/ping");
    while ping.0 != 503 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
        ping = server.get("/ping");
    }
    assert_eq!(ping.0, 503, "{}", server.log());
    let said: serde_json::Value = serde_json::from_slice(&ping.1).unwrap();
    assert_eq!(said["status"], "draining");
    let ready = server.get("/v2/health/ready");
    assert_eq!(ready.0, 503);
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&ready.1).unwrap()["ready"],
        false
    );
    assert_eq!(server.get("/v2/health/live").0, 200);
    // Requests routed here during the drain are answered, on new connections too.
    for _ in 0..3 {
        let answer = server.post("/invocations", &[("content-type", "image/png")], &png);
        assert_eq!(answer.status, 200, "{}", server.log());
    }
    let log = server.log_handle();
    let status = server.wait();
    assert!(status.success(), "exit status: {status}\n{}", log());
    let log = log();
    let draining = log.find("draining: still serving").expect("a drain logged");
    let closing = log.find("shutting down").expect("a shutdown logged");
    assert!(draining < closing, "{log}");
}

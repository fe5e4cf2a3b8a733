//! Hostile and unlucky clients against the connection layer (`celer::http::server`) over
//! real sockets: early refusals read by real Python clients (requests, urllib3,
//! http.client, aiohttp: `scripts/hostile_clients.py`) and curl; stalled uploads that
//! hold no inference slot and get 408; heads, idle keep-alive connections and unread
//! responses under their time limits; the connection cap; the memory budget of bodies in
//! transit. The pipeline is the `prob-guided` fixture (fast); some tests serve a
//! stand-in router to test the connection layer alone.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::routing::{get, post};
use celer::config::ConnLimits;
use celer::http::{routes, AppState};
use common::{app_state, bright_rectangle, fixture_dir, png_bytes, repo, StateOptions};

fn limits(mutate: impl FnOnce(&mut ConnLimits)) -> ConnLimits {
    let mut l = ConnLimits::default();
    mutate(&mut l);
    l
}

/// Serves `app` with `limits` on 127.0.0.1 until the test's runtime ends.
async fn serve(app: axum::Router, limits: ConnLimits) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(celer::http::server::serve(
        listener,
        app,
        limits,
        std::future::pending(),
    ));
    addr
}

fn fixture_state(max_body_bytes: usize, queue_capacity: usize) -> Arc<AppState> {
    let mut options = StateOptions {
        queue_capacity,
        ..StateOptions::default()
    };
    options.limits.max_body_bytes = max_body_bytes;
    Arc::new(app_state(&fixture_dir("prob-guided"), options))
}

fn python() -> PathBuf {
    common::venv_python(&[])
}

/// Runs `scripts/hostile_clients.py ARGS` and parses the JSON it prints.
async fn hostile_clients(args: Vec<String>) -> serde_json::Value {
    tokio::task::spawn_blocking(move || {
        let out = Command::new(python())
            .arg(repo("scripts/hostile_clients.py"))
            .args(&args)
            .output()
            .expect("running scripts/hostile_clients.py");
        assert!(
            out.status.success(),
            "hostile_clients.py {args:?} failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&out.stdout)))
    })
    .await
    .unwrap()
}

const CLIENTS: [&str; 4] = ["requests", "urllib3", "httpclient", "aiohttp"];

/// Every client read `status` with `code` for each of its requests: no reset, no broken
/// pipe, no disconnect.
fn assert_all_read(report: &serde_json::Value, status: u64, code: &str) {
    let answers = report["answers"].as_array().expect("answers");
    assert!(!answers.is_empty());
    for a in answers {
        assert_eq!(a["status"], status, "{}: {report}", report["client"]);
        assert_eq!(a["code"], code, "{}: {report}", report["client"]);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_30_mb_body_gets_413_read_by_every_python_client_and_curl() {
    let addr = serve(routes(fixture_state(1 << 20, 16)), ConnLimits::default()).await;
    let url = format!("http://{addr}/invocations");
    for client in CLIENTS {
        let report = hostile_clients(vec![
            "early".into(),
            url.clone(),
            "--client".into(),
            client.into(),
            "--bytes".into(),
            "30000000".into(),
            "--repeat".into(),
            "2".into(),
        ])
        .await;
        assert_all_read(&report, 413, "payload_too_large");
    }
    // curl, from a file (it reads the answer early, and still must see it).
    let file = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(file.path(), vec![0xabu8; 30_000_000]).unwrap();
    let out = Command::new("curl")
        .args(["-sS", "--noproxy", "*", "-H", "Content-Type: image/jpeg"])
        .arg("--data-binary")
        .arg(format!("@{}", file.path().display()))
        .args(["-w", "\n%{http_code}", &url])
        .output()
        .expect("running curl");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.ends_with("\n413"),
        "curl: {text} {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(text.contains("payload_too_large"), "curl: {text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_before_the_body_reach_python_clients_on_a_kept_alive_connection() {
    // 415: the Content-Type is refused before a byte of the 2 MB body is read.
    let addr = serve(routes(fixture_state(6 << 20, 16)), ConnLimits::default()).await;
    let url = format!("http://{addr}/invocations");
    for client in CLIENTS {
        let report = hostile_clients(vec![
            "early".into(),
            url.clone(),
            "--client".into(),
            client.into(),
            "--bytes".into(),
            "2000000".into(),
            "--content-type".into(),
            "text/plain".into(),
            "--repeat".into(),
            "3".into(),
        ])
        .await;
        assert_all_read(&report, 415, "unsupported_content_type");
    }

    // 503: every slot is held (one replica, one queue place: two slots), so the server
    // refuses before reading.
    let state = fixture_state(6 << 20, 1);
    let held = [
        state.scheduler.admit().unwrap(),
        state.scheduler.admit().unwrap(),
    ];
    let addr = serve(routes(state.clone()), ConnLimits::default()).await;
    let url = format!("http://{addr}/invocations");
    for client in CLIENTS {
        let report = hostile_clients(vec![
            "early".into(),
            url.clone(),
            "--client".into(),
            client.into(),
            "--bytes".into(),
            "2000000".into(),
            "--repeat".into(),
            "3".into(),
        ])
        .await;
        assert_all_read(&report, 503, "overloaded");
    }
    drop(held);
    assert_eq!(state.scheduler.in_flight(), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_uploads_hold_no_slot_and_get_408_within_the_body_limit() {
    // One replica and one queue place: two inference slots for 40 stalled uploads.
    let state = fixture_state(6 << 20, 1);
    let addr = serve(
        routes(state.clone()),
        limits(|l| {
            l.body_idle_timeout = Duration::from_millis(1500);
            l.body_timeout = Duration::from_secs(4);
        }),
    )
    .await;
    let image = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(image.path(), png_bytes(&bright_rectangle(64, 48))).unwrap();
    let report = hostile_clients(vec![
        "stall".into(),
        format!("http://{addr}/invocations"),
        "--connections".into(),
        "40".into(),
        "--normal".into(),
        "3".into(),
        "--normal-image".into(),
        image.path().display().to_string(),
        "--normal-type".into(),
        "image/png".into(),
    ])
    .await;
    for normal in report["normal"].as_array().unwrap() {
        assert_eq!(normal["status"], 200, "{report}");
    }
    assert_eq!(
        report["stalled_still_open_after_normal"], 40,
        "the normal requests were served while every stalled upload was held: {report}"
    );
    for stalled in report["stalled"].as_array().unwrap() {
        assert_eq!(stalled["status"], 408, "{report}");
        assert_eq!(stalled["code"], "body_timeout", "{report}");
        let after = stalled["after_s"].as_f64().unwrap();
        assert!(after < 4.0, "408 after {after} s: {report}");
    }
    assert_eq!(state.scheduler.in_flight(), 0);
}

/// A stand-in app for the connection layer alone: `/ok`, `/big` (64 MiB), `/echo` (the
/// body's length).
fn standin_app() -> axum::Router {
    axum::Router::new()
        .route("/ok", get(|| async { "ok" }))
        .route("/big", get(|| async { vec![7u8; 64 << 20] }))
        .route(
            "/echo",
            post(|body: axum::body::Bytes| async move { body.len().to_string() }),
        )
}

/// Reads until the server closes (or `limit` passes); how long that took and what came.
fn read_until_closed(stream: &mut TcpStream, limit: Duration) -> (Duration, Vec<u8>, bool) {
    stream.set_read_timeout(Some(limit)).unwrap();
    let started = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 65536];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => return (started.elapsed(), got, true),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {
                return (started.elapsed(), got, true)
            }
            Err(_) => return (started.elapsed(), got, false),
        }
        if started.elapsed() > limit {
            return (started.elapsed(), got, false);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn heads_and_idle_connections_have_separate_time_limits() {
    let addr = serve(
        standin_app(),
        limits(|l| {
            l.header_timeout = Duration::from_millis(400);
            l.keep_alive_timeout = Duration::from_millis(1500);
        }),
    )
    .await;
    tokio::task::spawn_blocking(move || {
        // Silent from the start: closed at the header limit.
        let mut silent = TcpStream::connect(addr).unwrap();
        let (took, _, closed) = read_until_closed(&mut silent, Duration::from_secs(5));
        assert!(closed && took < Duration::from_millis(1200), "{took:?}");

        // Half a head: closed at the header limit.
        let mut slow = TcpStream::connect(addr).unwrap();
        slow.write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\n").unwrap();
        let (took, got, closed) = read_until_closed(&mut slow, Duration::from_secs(5));
        assert!(closed && took < Duration::from_millis(1200), "{took:?}");
        assert!(!got.starts_with(b"HTTP/1.1 200"));

        // Idle after an answer: kept for the keep-alive limit, not the header limit.
        let mut idle = TcpStream::connect(addr).unwrap();
        idle.write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        let mut first = [0u8; 256];
        let n = idle.read(&mut first).unwrap();
        assert!(first[..n].starts_with(b"HTTP/1.1 200"));
        let (took, _, closed) = read_until_closed(&mut idle, Duration::from_secs(5));
        assert!(closed, "never closed");
        assert!(
            took > Duration::from_millis(1200) && took < Duration::from_millis(2500),
            "idle connection closed after {took:?}"
        );
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_is_cut_off_at_the_send_limit() {
    let addr = serve(
        standin_app(),
        limits(|l| l.send_timeout = Duration::from_millis(800)),
    )
    .await;
    tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(addr).unwrap();
        stream
            .write_all(b"GET /big HTTP/1.1\r\nHost: x\r\n\r\n")
            .unwrap();
        // Do not read while the server would have to wait for us.
        std::thread::sleep(Duration::from_secs(3));
        let (_, got, closed) = read_until_closed(&mut stream, Duration::from_secs(10));
        assert!(closed, "the connection was never closed");
        assert!(
            got.len() < 64 << 20,
            "the whole response arrived: the server waited for the reader"
        );
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_connection_cap_holds_new_connections_until_one_closes() {
    let addr = serve(
        standin_app(),
        limits(|l| {
            l.max_connections = 2;
            l.header_timeout = Duration::from_millis(1000);
        }),
    )
    .await;
    tokio::task::spawn_blocking(move || {
        let ask = || {
            let started = Instant::now();
            let mut s = TcpStream::connect(addr).unwrap();
            s.write_all(b"GET /ok HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
                .unwrap();
            let (_, got, _) = read_until_closed(&mut s, Duration::from_secs(10));
            assert!(
                got.starts_with(b"HTTP/1.1 200"),
                "{:?}",
                String::from_utf8_lossy(&got)
            );
            started.elapsed()
        };
        // Below the cap: answered (how fast is not this test's business).
        ask();
        // Two silent connections take both places until the header limit closes them.
        let _a = TcpStream::connect(addr).unwrap();
        let _b = TcpStream::connect(addr).unwrap();
        std::thread::sleep(Duration::from_millis(100));
        let waited = ask();
        assert!(
            waited > Duration::from_millis(700) && waited < Duration::from_millis(3000),
            "answered after {waited:?}"
        );
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_body_gets_408_at_the_whole_body_limit_and_the_budget_bounds_bodies() {
    let state = fixture_state(6 << 20, 16);
    let addr = serve(
        routes(state.clone()),
        limits(|l| {
            l.body_timeout = Duration::from_millis(1200);
            l.body_idle_timeout = Duration::from_millis(800);
            l.body_buffer_bytes = 256 * 1024;
        }),
    )
    .await;
    tokio::task::spawn_blocking(move || {
        // One byte every 300 ms: never idle for 800 ms, over the 1.2 s whole-body limit.
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(
            b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: image/png\r\nContent-Length: 1000\r\n\r\n",
        )
        .unwrap();
        let started = Instant::now();
        let mut answer = Vec::new();
        s.set_read_timeout(Some(Duration::from_millis(300))).unwrap();
        let mut buf = [0u8; 4096];
        while started.elapsed() < Duration::from_secs(5) {
            let _ = s.write_all(b"x");
            match s.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => answer.extend_from_slice(&buf[..n]),
                Err(_) => {}
            }
            if answer.windows(4).any(|w| w == b"\r\n\r\n") && answer.ends_with(b"}") {
                break;
            }
        }
        let text = String::from_utf8_lossy(&answer);
        assert!(text.starts_with("HTTP/1.1 408"), "{text}");
        assert!(text.contains("\"code\":\"body_timeout\""), "{text}");
        assert!(text.to_ascii_lowercase().contains("connection: close"), "{text}");
        let took = started.elapsed();
        assert!(took > Duration::from_millis(1000) && took < Duration::from_millis(2500), "{took:?}");

    })
    .await
    .unwrap();

    // A body over the memory budget of bodies in transit: 503, the budget given back.
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let response = client
        .post(format!("http://{addr}/invocations"))
        .header("content-type", "image/png")
        .body(vec![0u8; 512 * 1024])
        .send()
        .await
        .unwrap();
    assert_eq!(response.status().as_u16(), 503);
    let json: serde_json::Value = serde_json::from_slice(&response.bytes().await.unwrap()).unwrap();
    assert_eq!(json["code"], "overloaded", "{json}");
    let ok = client
        .post(format!("http://{addr}/invocations"))
        .header("content-type", "image/png")
        .body(png_bytes(&bright_rectangle(64, 48)))
        .send()
        .await
        .unwrap();
    assert_eq!(ok.status().as_u16(), 200);
    assert_eq!(state.scheduler.in_flight(), 0);
}

/// Sends a head with `Expect: 100-continue` for a body of `length`, and reads what comes
/// before the client would give up waiting for `100 Continue`.
fn head_expecting_continue(addr: SocketAddr, content_type: &str, length: usize) -> TcpStream {
    let mut stream = TcpStream::connect(addr).unwrap();
    write!(
        stream,
        "POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n\
         Content-Length: {length}\r\nExpect: 100-continue\r\n\r\n"
    )
    .unwrap();
    stream
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_client_that_expects_100_continue_is_not_asked_for_its_body() {
    // Every slot held (one replica, one queue place): the request is refused from its head.
    let state = fixture_state(6 << 20, 1);
    let held = [
        state.scheduler.admit().unwrap(),
        state.scheduler.admit().unwrap(),
    ];
    // An unread body would be waited for, and drained, for a minute: longer than the
    // test reads.
    let lingering = limits(|l| {
        l.linger = Duration::from_secs(60);
        l.body_idle_timeout = Duration::from_secs(60);
    });
    let addr = serve(routes(state.clone()), lingering).await;
    let png = png_bytes(&bright_rectangle(64, 48));
    tokio::task::spawn_blocking(move || {
        // Refused: the 503 comes without a `100 Continue` before it (the client would then
        // upload 2 MB to be discarded), and the connection closes after it rather than wait
        // for a body the client will not send.
        let mut refused = head_expecting_continue(addr, "image/jpeg", 2_000_000);
        let (_, got, closed) = read_until_closed(&mut refused, Duration::from_secs(10));
        let text = String::from_utf8_lossy(&got).to_ascii_lowercase();
        assert!(text.starts_with("http/1.1 503"), "{text}");
        assert!(!text.contains("100 continue"), "{text}");
        assert!(text.contains("\"overloaded\""), "{text}");
        assert!(closed, "the connection stays open: {text}");
        drop(held);

        // The twin, admitted: asked for its body with `100 Continue`, then answered.
        let mut admitted = head_expecting_continue(addr, "image/png", png.len());
        admitted
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        let mut interim = [0u8; 25];
        admitted.read_exact(&mut interim).unwrap();
        assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
        admitted.write_all(&png).unwrap();
        let mut status = [0u8; 12];
        admitted.read_exact(&mut status).unwrap();
        assert_eq!(&status, b"HTTP/1.1 200");
    })
    .await
    .unwrap();
}

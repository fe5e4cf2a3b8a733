//! The Open Inference Protocol over gRPC against `celer serve` over sockets: Triton's
//! client (tritonclient.grpc) and KServe's (kserve.InferenceGRPCClient) run
//! tests/grpc_clients.py, gRPC health is called as Kubernetes' probe calls it, hostile
//! calls run tests/grpc_hostile.py while streams stalled mid-message (raw HTTP/2, written
//! here) hold their connections, and the server must keep answering throughout.

mod common;
mod serve_support;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::Command;
use std::time::{Duration, Instant};

use common::{fetched, model_dir, printed, repo, venv_python};
use serve_support::{free_port, Server};

/// `celer serve` with gRPC on a free port, and `args`; returns it and the gRPC address.
fn serve(args: &[&str], env: &[(&str, &str)]) -> (Server, SocketAddr) {
    let port = free_port();
    let mut all = vec!["--grpc-port".to_string(), port.to_string()];
    all.extend(args.iter().map(|a| a.to_string()));
    let server = Server::start(&model_dir("u2netp"), all, env);
    let grpc = SocketAddr::from(([127, 0, 0, 1], port));
    assert!(
        server
            .log()
            .contains(&format!("grpc_address=127.0.0.1:{port}")),
        "no gRPC listener in the log:\n{}",
        server.log()
    );
    (server, grpc)
}

/// `tests/SCRIPT ARGS` with .venv's Python, which must import `module`; it must succeed
/// and print `done`.
fn python(server: &Server, module: &str, script: &str, args: &[String], done: &str) {
    let out = Command::new(venv_python(&[module]))
        .arg(repo(&format!("tests/{script}")))
        .args(args)
        .output()
        .expect("python runs");
    let said = printed(&out);
    eprintln!("{said}");
    assert!(
        out.status.success(),
        "tests/{script} failed:\n{said}\nserver log:\n{}",
        server.log()
    );
    assert!(said.contains(done), "{said}");
}

#[test]
fn triton_and_kserve_grpc_clients_get_the_alpha_of_invocations() {
    let (server, grpc) = serve(&[], &[("CELER_MODEL_NAME", "u2netp")]);
    for (client, module, done) in [
        ("triton", "tritonclient.grpc", "tritonclient.grpc: ok"),
        ("kserve", "kserve", "kserve grpc client: ok"),
    ] {
        let args = [
            client.to_string(),
            grpc.to_string(),
            server.host_port(),
            fetched("astronaut.jpg").display().to_string(),
            fetched("chelsea.png").display().to_string(),
            "u2netp".to_string(),
        ];
        python(&server, module, "grpc_clients.py", &args, done);
    }
    // gRPC's inferences are in /metrics: by gRPC code, and in Triton's totals.
    let metrics = String::from_utf8(server.get("/metrics").1).unwrap();
    let count = |needle: &str| -> f64 {
        metrics
            .lines()
            .filter(|l| l.starts_with("celer_grpc_requests") && l.contains(needle))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    assert!(count("code=\"OK\"") >= 4.0, "{metrics}");
    assert!(count("code=\"INVALID_ARGUMENT\"") >= 3.0, "{metrics}");
    assert!(count("code=\"NOT_FOUND\"") >= 2.0, "{metrics}");
    assert!(server.stop().success());
}

/// A gRPC call whose message never finishes arriving: HTTP/2 written by hand (the
/// connection preface, SETTINGS, a HEADERS frame for `ModelInfer`, and a DATA frame whose
/// gRPC prefix announces 1 MB of which 100 bytes come), then nothing. The server's
/// SETTINGS and PINGs are acknowledged, as a live but stalled client would.
struct StalledCall {
    socket: TcpStream,
}

/// An HTTP/2 frame: 24-bit length, type, flags, stream id, payload.
fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
    f.extend([kind, flags]);
    f.extend(stream.to_be_bytes());
    f.extend(payload);
    f
}

/// HPACK's "literal header field without indexing, new name", lengths under 127.
fn header(name: &str, value: &str) -> Vec<u8> {
    let mut h = vec![0, name.len() as u8];
    h.extend(name.as_bytes());
    h.push(value.len() as u8);
    h.extend(value.as_bytes());
    h
}

const HEADERS: u8 = 0x1;
const RST_STREAM: u8 = 0x3;
const SETTINGS: u8 = 0x4;
const PING: u8 = 0x6;
const GOAWAY: u8 = 0x7;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const ACK: u8 = 0x1;

impl StalledCall {
    fn open(address: SocketAddr) -> Self {
        let mut socket = TcpStream::connect(address).expect("connects");
        let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        out.extend(frame(SETTINGS, 0, 0, &[]));
        let mut block = Vec::new();
        for (name, value) in [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", "/inference.GRPCInferenceService/ModelInfer"),
            (":authority", "127.0.0.1"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ] {
            block.extend(header(name, value));
        }
        out.extend(frame(HEADERS, END_HEADERS, 1, &block));
        let mut data = vec![0u8];
        data.extend(1_000_000u32.to_be_bytes());
        data.extend([0x0a; 100]);
        out.extend(frame(0x0, 0, 1, &data));
        socket.write_all(&out).expect("writes");
        Self { socket }
    }

    /// Reads frames until the server ends stream 1 (trailers with END_STREAM, a reset,
    /// or GOAWAY and close), answering SETTINGS and PING; how it ended, or `None` if it
    /// had not within `within`.
    fn ended_within(&mut self, within: Duration) -> Option<&'static str> {
        let until = Instant::now() + within;
        let mut buffer = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            let left = until.checked_duration_since(Instant::now())?;
            self.socket
                .set_read_timeout(Some(left.max(Duration::from_millis(1))))
                .unwrap();
            match self.socket.read(&mut chunk) {
                Ok(0) => return Some("closed"),
                Ok(n) => buffer.extend_from_slice(&chunk[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return None
                }
                Err(_) => return Some("reset"),
            }
            while buffer.len() >= 9 {
                let length = u32::from_be_bytes([0, buffer[0], buffer[1], buffer[2]]) as usize;
                if buffer.len() < 9 + length {
                    break;
                }
                let (kind, flags) = (buffer[3], buffer[4]);
                let stream = u32::from_be_bytes(buffer[5..9].try_into().unwrap()) & 0x7fff_ffff;
                let payload = buffer[9..9 + length].to_vec();
                buffer.drain(..9 + length);
                match (kind, stream) {
                    (SETTINGS, 0) if flags & ACK == 0 => {
                        let _ = self.socket.write_all(&frame(SETTINGS, ACK, 0, &[]));
                    }
                    (PING, 0) if flags & ACK == 0 => {
                        let _ = self.socket.write_all(&frame(PING, ACK, 0, &payload));
                    }
                    (HEADERS, 1) if flags & END_STREAM != 0 => return Some("trailers"),
                    (RST_STREAM, 1) => return Some("RST_STREAM"),
                    (GOAWAY, 0) => return Some("GOAWAY"),
                    _ => {}
                }
            }
        }
    }
}

#[test]
fn hostile_calls_get_statuses_and_stalled_streams_hold_nothing() {
    // One replica and one queue place: two requests admitted at once. Calls end within
    // the deadline plus the whole-body time (3 s + 1 s). Warmed up at the photo's size, so
    // that the flood is priced from a warm run: priced from a cold first run (1.5 s on a
    // busy CI machine) at twice that, the cold start's margin, every call of the flood
    // was refused for the 3 s deadline.
    let max_message = 2_000_000;
    let (server, grpc) = serve(
        &[
            "--replicas",
            "1",
            "--queue-capacity",
            "1",
            "--max-body-bytes",
            &max_message.to_string(),
            "--deadline-s",
            "3",
            "--body-timeout-ms",
            "1000",
            "--warmup-size",
            "512x512",
        ],
        &[],
    );
    // More stalled calls than the server admits: had they held slots, nothing would run.
    let mut stalled: Vec<StalledCall> = (0..6).map(|_| StalledCall::open(grpc)).collect();
    let started = Instant::now();
    python(
        &server,
        "tritonclient.grpc",
        "grpc_hostile.py",
        &[
            grpc.to_string(),
            fetched("astronaut.jpg").display().to_string(),
            max_message.to_string(),
        ],
        "grpc hostile: ok",
    );
    // The stalled calls are ended by the server, each within its time limit.
    for (i, call) in stalled.iter_mut().enumerate() {
        let left = Duration::from_secs(15).saturating_sub(started.elapsed());
        let how = call.ended_within(left);
        assert!(
            how.is_some(),
            "stalled call {i} still open after {:?}:\n{}",
            started.elapsed(),
            server.log()
        );
        eprintln!("stalled call {i}: ended by the server ({})", how.unwrap());
    }
    // Still up: REST and gRPC both answer.
    assert_eq!(server.get("/ping").0, 200);
    assert_eq!(server.get("/v2/health/ready").0, 200);
    python(
        &server,
        "tritonclient.grpc",
        "grpc_clients.py",
        &[
            "triton".to_string(),
            grpc.to_string(),
            server.host_port(),
            fetched("astronaut.jpg").display().to_string(),
            fetched("chelsea.png").display().to_string(),
            "celer".to_string(),
        ],
        "tritonclient.grpc: ok",
    );
    assert!(server.stop().success());
}

/// gRPC health's Check, as the grpcio client calls it: SERVING (1) or NOT_SERVING (2).
fn health(grpc: SocketAddr) -> String {
    let script = r#"
import sys, grpc
with grpc.insecure_channel(sys.argv[1]) as channel:
    check = channel.unary_unary("/grpc.health.v1.Health/Check",
        request_serializer=lambda s: b"", response_deserializer=lambda d: d)
    print({b"\x08\x01": "SERVING", b"\x08\x02": "NOT_SERVING"}.get(check("", timeout=10), "?"))
"#;
    let out = Command::new(venv_python(&["grpc"]))
        .args(["-c", script, &grpc.to_string()])
        .output()
        .expect("python runs");
    assert!(out.status.success(), "{}", printed(&out));
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn grpc_health_says_not_serving_while_draining_then_the_port_closes() {
    let (server, grpc) = serve(&["--drain-s", "3"], &[]);
    assert_eq!(health(grpc), "SERVING");
    server.terminate();
    let started = Instant::now();
    // Readiness turns at SIGTERM; the port still answers during the drain.
    loop {
        let said = health(grpc);
        if said == "NOT_SERVING" {
            break;
        }
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "still {said} after SIGTERM:\n{}",
            server.log()
        );
    }
    let status = server.wait();
    assert!(status.success(), "{status}");
    assert!(
        TcpStream::connect(grpc).is_err(),
        "the gRPC port still accepts after exit"
    );
}

/// `celer bench http` with the REST and gRPC routes taking turns: the JSON report of
/// each, and a wrong model counted as gRPC's NOT_FOUND (5), not as an answer.
#[test]
fn bench_http_measures_rest_and_grpc_side_by_side() {
    let (server, grpc) = serve(&[], &[]);
    let dir = tempfile::tempdir().unwrap();
    let report = |name: &str| dir.path().join(name);
    let bench = |args: &[String]| {
        let out = Command::new(env!("CARGO_BIN_EXE_celer"))
            .args(["bench", "http", "--warmup-s", "0", "--requests", "3"])
            .args([
                "--input",
                &fetched("photo-320x320.jpg").display().to_string(),
            ])
            .args(args)
            .output()
            .expect("celer bench runs");
        assert!(out.status.success(), "{}", printed(&out));
    };
    let read = |path: std::path::PathBuf| -> serde_json::Value {
        let text = std::fs::read_to_string(&path).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        v.as_array().and_then(|a| a.first()).cloned().unwrap_or(v)
    };
    let s = |v: &str| v.to_string();
    bench(&[
        s("--url"),
        server.url(""),
        s("--route"),
        s("v2"),
        s("--label"),
        s("rest"),
        s("--json"),
        report("rest.json").display().to_string(),
        s("--url"),
        format!("http://{grpc}"),
        s("--route"),
        s("grpc"),
        s("--label"),
        s("grpc"),
        s("--json"),
        report("grpc.json").display().to_string(),
        s("--v2-output"),
        s("alpha"),
    ]);
    for name in ["rest.json", "grpc.json"] {
        let point = read(report(name));
        assert_eq!(point["ok"], 3, "{name}: {point}");
        assert_eq!(point["errors"], serde_json::json!({}), "{name}: {point}");
    }
    bench(&[
        s("--url"),
        format!("http://{grpc}"),
        s("--route"),
        s("grpc"),
        s("--model-name"),
        s("nobody"),
        s("--json"),
        report("nobody.json").display().to_string(),
    ]);
    let point = read(report("nobody.json"));
    assert_eq!(point["ok"], 0, "{point}");
    assert_eq!(point["errors"]["grpc 5"], 3, "{point}");
    assert!(server.stop().success());
}

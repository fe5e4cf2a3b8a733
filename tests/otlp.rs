//! Traces over OTLP, end to end: `celer serve` with `OTEL_EXPORTER_OTLP_ENDPOINT` set
//! exports its spans to tests/otlp_receiver.py, which decodes them with the OpenTelemetry
//! project's own classes (opentelemetry-proto). A request sent with a W3C `traceparent`
//! comes back as a span tree in that trace: the server span, child of the caller's, and a
//! child per pipeline stage, in both OTLP/HTTP encodings.

mod common;
mod serve_support;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::{gradient_png, model_dir, repo, venv_python};
use serde_json::Value;
use serve_support::{free_port, Server};

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const CALLER_SPAN: &str = "00f067aa0ba902b7";

/// tests/otlp_receiver.py, running; its lines (one per span) gathered as they come.
struct Receiver {
    child: Child,
    port: u16,
    lines: Arc<Mutex<Vec<Value>>>,
}

impl Receiver {
    fn start() -> Self {
        let mut child = Command::new(venv_python(&[
            "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
        ]))
        .arg(repo("tests/otlp_receiver.py"))
        .stdout(Stdio::piped())
        .spawn()
        .expect("python runs");
        let mut out = BufReader::new(child.stdout.take().expect("stdout"));
        let mut first = String::new();
        out.read_line(&mut first)
            .expect("the receiver says its port");
        let port = serde_json::from_str::<Value>(&first).expect("JSON")["listening"]
            .as_u64()
            .expect("a port") as u16;
        let lines = Arc::new(Mutex::new(Vec::new()));
        let gathered = lines.clone();
        std::thread::spawn(move || {
            for line in out.lines().map_while(Result::ok) {
                let v: Value = serde_json::from_str(&line).expect("the receiver prints JSON");
                gathered.lock().unwrap().push(v);
            }
        });
        Self { child, port, lines }
    }

    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The spans of `trace` once `count` have come (at most 30 s); fails on a line the
    /// receiver could not decode.
    fn spans_of(&self, trace: &str, count: usize) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let lines = self.lines.lock().unwrap().clone();
            if let Some(e) = lines.iter().find(|l| l.get("error").is_some()) {
                panic!("the receiver refused an export: {e}");
            }
            let spans: Vec<Value> = lines
                .into_iter()
                .filter(|l| l["trace_id"] == trace)
                .collect();
            if spans.len() >= count || Instant::now() > deadline {
                return spans;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn all(&self) -> Vec<Value> {
        self.lines.lock().unwrap().clone()
    }
}

impl Drop for Receiver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn server(receiver: &Receiver, protocol: &str) -> Server {
    Server::start(
        &model_dir("u2netp"),
        std::iter::empty::<&str>(),
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint().as_str()),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", protocol),
            ("OTEL_SERVICE_NAME", "celer-under-test"),
            ("OTEL_BSP_SCHEDULE_DELAY", "50"),
        ],
    )
}

/// The stages U2NetP's cut-out runs, in order (its trimap feeds a guided-filter matting).
const STAGES: [&str; 8] = [
    "decode",
    "queue",
    "preprocess",
    "model",
    "trimap",
    "matting",
    "composite",
    "encode",
];

/// `spans` form the tree of one `POST /invocations` in `trace`, under `parent` when the
/// caller sent one; returns the server span.
fn check_tree(spans: &[Value], trace: &str, parent: Option<&str>, content_type: &str) -> Value {
    let servers: Vec<&Value> = spans.iter().filter(|s| s["kind"] == 2).collect();
    assert_eq!(servers.len(), 1, "one server span: {spans:#?}");
    let root = servers[0].clone();
    assert_eq!(root["name"], "POST /invocations", "{root}");
    assert_eq!(root["trace_id"], trace);
    assert_eq!(root["parent_span_id"], parent.unwrap_or(""), "{root}");
    assert_eq!(root["content_type"], content_type);
    assert_eq!(root["resource"]["service.name"], "celer-under-test");
    assert_eq!(root["scope"], "celer");
    assert_eq!(root["attributes"]["http.request.method"], "POST");
    assert_eq!(root["attributes"]["http.route"], "/invocations");
    assert_eq!(root["attributes"]["http.response.status_code"], 200);
    assert_eq!(root["attributes"]["celer.device"], "cpu");
    assert_eq!(root["status"], 0, "{root}");
    let (start, end) = (
        root["start"].as_u64().unwrap(),
        root["end"].as_u64().unwrap(),
    );
    assert!(start < end, "{root}");

    let mut children: Vec<&Value> = spans.iter().filter(|s| s["kind"] == 1).collect();
    children.sort_by_key(|s| s["start"].as_u64());
    let names: Vec<&str> = children.iter().filter_map(|s| s["name"].as_str()).collect();
    assert_eq!(names, STAGES, "{children:#?}");
    for child in &children {
        assert_eq!(child["parent_span_id"], root["span_id"], "{child}");
        assert_eq!(child["trace_id"], trace);
        let (s, e) = (
            child["start"].as_u64().unwrap(),
            child["end"].as_u64().unwrap(),
        );
        assert!(start <= s && s <= e && e <= end, "{child} outside {root}");
    }
    // Each stage ends before the next begins.
    for pair in children.windows(2) {
        assert!(
            pair[0]["end"].as_u64() <= pair[1]["start"].as_u64(),
            "{pair:#?}"
        );
    }
    root
}

#[test]
fn a_traced_request_is_exported_as_a_span_tree_in_the_callers_trace() {
    let receiver = Receiver::start();
    let server = server(&receiver, "http/protobuf");
    let photo = gradient_png(96, 64);

    // The caller did not sample this one: nothing is exported for it.
    let unsampled = "0af7651916cd43dd8448eb211c80319c";
    let answer = server.post(
        "/invocations",
        &[
            ("content-type", "image/png"),
            (
                "traceparent",
                &format!("00-{unsampled}-b7ad6b7169203331-00"),
            ),
        ],
        &photo,
    );
    assert_eq!(answer.status, 200);
    // Health checks are not traced.
    assert_eq!(server.get("/ping").0, 200);

    let answer = server.post(
        "/invocations",
        &[
            ("content-type", "image/png"),
            ("traceparent", &format!("00-{TRACE}-{CALLER_SPAN}-01")),
            ("tracestate", "congo=t61rcWkgMzE"),
            ("x-request-id", "traced-1"),
        ],
        &photo,
    );
    assert_eq!(answer.status, 200);
    let spans = receiver.spans_of(TRACE, 1 + STAGES.len());
    let root = check_tree(&spans, TRACE, Some(CALLER_SPAN), "application/x-protobuf");
    assert_eq!(root["trace_state"], "congo=t61rcWkgMzE");
    assert_eq!(root["attributes"]["celer.request_id"], "traced-1");
    let queue = spans.iter().find(|s| s["name"] == "queue").unwrap();
    assert_eq!(queue["attributes"]["celer.device"], "cpu");

    // Without a traceparent the request starts a trace of its own.
    let answer = server.post("/invocations", &[("content-type", "image/png")], &photo);
    assert_eq!(answer.status, 200);
    let deadline = Instant::now() + Duration::from_secs(30);
    let fresh = loop {
        let roots: Vec<Value> = receiver
            .all()
            .into_iter()
            .filter(|s| s["kind"] == 2 && s["trace_id"] != TRACE)
            .collect();
        if !roots.is_empty() || Instant::now() > deadline {
            break roots;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(fresh.len(), 1, "{fresh:#?}");
    let new_trace = fresh[0]["trace_id"].as_str().unwrap().to_string();
    assert_ne!(new_trace, unsampled);
    let spans = receiver.spans_of(&new_trace, 1 + STAGES.len());
    check_tree(&spans, &new_trace, None, "application/x-protobuf");

    // The access line names the trace, so logs and traces meet.
    let log = server.log();
    assert!(
        log.lines()
            .any(|l| l.contains("traced-1") && l.contains(&format!("trace_id={TRACE}"))),
        "{log}"
    );
    assert!(server.stop().success());
    let everything = receiver.all();
    assert!(
        everything.iter().all(|s| s["trace_id"] != unsampled),
        "an unsampled request was exported"
    );
    assert!(
        everything
            .iter()
            .all(|s| !s["name"].as_str().unwrap_or("").contains("/ping")),
        "a health check was traced"
    );
}

#[test]
fn spans_go_as_otlp_json_when_asked() {
    let receiver = Receiver::start();
    let server = server(&receiver, "http/json");
    let answer = server.post(
        "/invocations",
        &[
            ("content-type", "image/png"),
            ("traceparent", &format!("00-{TRACE}-{CALLER_SPAN}-01")),
        ],
        &gradient_png(96, 64),
    );
    assert_eq!(answer.status, 200);
    let spans = receiver.spans_of(TRACE, 1 + STAGES.len());
    check_tree(&spans, TRACE, Some(CALLER_SPAN), "application/json");
    assert!(server.stop().success());
}

/// gRPC's ModelInfer, called by Triton's client with the caller's `traceparent` in its
/// metadata: the same tree, its server span named by the RPC.
#[test]
fn a_traced_grpc_call_is_exported_in_the_callers_trace() {
    let receiver = Receiver::start();
    let port = free_port();
    let server = Server::start(
        &model_dir("u2netp"),
        ["--grpc-port".to_string(), port.to_string()],
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint().as_str()),
            ("OTEL_SERVICE_NAME", "celer-under-test"),
            ("OTEL_BSP_SCHEDULE_DELAY", "50"),
        ],
    );
    let trace = "5cf92f3577b34da6a3ce929d0e0e4737";
    let script = r#"
import sys, numpy as np, tritonclient.grpc as g
c = g.InferenceServerClient(sys.argv[1])
image = g.InferInput("image", [1], "BYTES")
image.set_data_from_numpy(np.array([open(sys.argv[2], "rb").read()], dtype=np.object_))
r = c.infer("celer", [image], headers={"traceparent": sys.argv[3], "x-request-id": "grpc-traced"})
print(r.as_numpy("alpha").shape)
"#;
    let photo = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(photo.path(), gradient_png(96, 64)).unwrap();
    let out = Command::new(venv_python(&["tritonclient.grpc"]))
        .args(["-c", script, &format!("127.0.0.1:{port}")])
        .arg(photo.path())
        .arg(format!("00-{trace}-{CALLER_SPAN}-01"))
        .output()
        .expect("python runs");
    assert!(out.status.success(), "{}", common::printed(&out));

    let spans = receiver.spans_of(trace, 1 + STAGES.len());
    let root = spans
        .iter()
        .find(|s| s["kind"] == 2)
        .unwrap_or_else(|| panic!("no server span: {spans:#?}"))
        .clone();
    assert_eq!(
        root["name"], "inference.GRPCInferenceService/ModelInfer",
        "{root}"
    );
    assert_eq!(root["parent_span_id"], CALLER_SPAN, "{root}");
    assert_eq!(root["attributes"]["rpc.system"], "grpc", "{root}");
    assert_eq!(root["attributes"]["rpc.method"], "ModelInfer", "{root}");
    assert_eq!(root["attributes"]["rpc.grpc.status_code"], 0, "{root}");
    assert_eq!(
        root["attributes"]["celer.request_id"], "grpc-traced",
        "{root}"
    );
    assert_eq!(root["status"], 0, "{root}");
    let mut children: Vec<&Value> = spans.iter().filter(|s| s["kind"] == 1).collect();
    children.sort_by_key(|s| s["start"].as_u64());
    let names: Vec<&str> = children.iter().filter_map(|s| s["name"].as_str()).collect();
    assert_eq!(names, STAGES, "{children:#?}");
    assert!(children
        .iter()
        .all(|c| c["parent_span_id"] == root["span_id"]));
    let log = server.log();
    assert!(
        log.lines()
            .any(|l| l.contains("grpc-traced") && l.contains(&format!("trace_id={trace}"))),
        "{log}"
    );
    assert!(server.stop().success());
}

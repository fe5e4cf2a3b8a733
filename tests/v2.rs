//! The Open Inference Protocol (KServe v2) routes of `celer serve` over sockets: Triton's
//! own Python client (tritonclient.http) runs tests/v2_clients.py and KServe's
//! (kserve.InferenceRESTClient) runs tests/v2_kserve_client.py against it, both installed
//! into .venv by scripts/setup-python; the protocol's errors and the shared limits are
//! checked here.

mod common;
mod serve_support;

use std::process::Command;

use base64::Engine;
use common::{fetched, model_dir, printed, repo, venv_python};
use serve_support::Server;

/// `script` (under tests/) with .venv's Python against `server`, on `photo` and `more`
/// arguments; the client library must import (`make python`), and the script must end
/// by printing `done`.
fn python_client(
    server: &Server,
    import: &str,
    script: &str,
    photo: &str,
    more: &[&str],
    done: &str,
) {
    let out = Command::new(venv_python(&[import]))
        .arg(repo(&format!("tests/{script}")))
        .arg(server.host_port())
        .arg(fetched(photo))
        .args(more)
        .output()
        .expect("python runs");
    let said = printed(&out);
    eprintln!("{said}");
    assert!(
        out.status.success(),
        "tests/{script} on {photo} failed:\n{said}\nserver log:\n{}",
        server.log()
    );
    assert!(said.contains(done), "{said}");
}

/// tests/v2_clients.py (tritonclient.http) against `server`, on `photo`.
fn triton_client(server: &Server, photo: &str) {
    python_client(
        server,
        "tritonclient.http",
        "v2_clients.py",
        photo,
        &[],
        "tritonclient: ok",
    );
}

#[test]
fn tritonclient_gets_the_cutout_of_invocations() {
    let server = Server::start(
        &model_dir("u2netp"),
        std::iter::empty::<&str>(),
        &[("CELER_MODEL_NAME", "celer")],
    );
    // Upright from EXIF orientation 6, and a square photo.
    triton_client(&server, "chelsea-exif6.jpg");
    triton_client(&server, "astronaut.jpg");
    // Inferences are counted on /metrics with /invocations' figures, and under Triton's
    // names, types and labels as Prometheus' own parser reads them.
    let scraped = scrape(&server);
    let family = |name: &str| scraped["families"][name].clone();
    let only = |name: &str, kind: &str| -> serde_json::Value {
        let f = family(name);
        assert_eq!(f["type"], kind, "{name}: {f}");
        let samples = f["samples"].as_array().cloned().unwrap_or_default();
        assert_eq!(samples.len(), 1, "{name}: {f}");
        samples[0].clone()
    };
    let model = serde_json::json!({"model": "celer", "version": "1"});
    // As many as the inferences answered (v2 and /invocations), each its own model run
    // (no batching).
    let answered: f64 = family("celer_http_requests")["samples"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|s| s["labels"]["path"] != "/ping" && s["labels"]["status"] == "200")
        .filter_map(|s| s["value"].as_f64())
        .sum();
    assert!(answered >= 2.0, "{scraped}");
    for name in [
        "nv_inference_request_success",
        "nv_inference_count",
        "nv_inference_exec_count",
    ] {
        let sample = only(name, "counter");
        assert_eq!(sample["labels"], model, "{sample}");
        assert_eq!(sample["value"].as_f64(), Some(answered), "{sample}");
    }
    for name in [
        "nv_inference_request_duration_us",
        "nv_inference_queue_duration_us",
        "nv_inference_compute_input_duration_us",
        "nv_inference_compute_infer_duration_us",
        "nv_inference_compute_output_duration_us",
    ] {
        let sample = only(name, "counter");
        assert_eq!(sample["labels"], model, "{sample}");
        assert!(sample["value"].as_f64().is_some(), "{sample}");
    }
    for name in [
        "nv_inference_request_duration_us",
        "nv_inference_compute_infer_duration_us",
    ] {
        assert!(
            only(name, "counter")["value"].as_f64() > Some(0.0),
            "{name}"
        );
    }
    let failures = family("nv_inference_request_failure");
    assert_eq!(failures["type"], "counter");
    let reasons: Vec<&str> = failures["samples"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s["labels"]["reason"].as_str())
        .collect();
    assert_eq!(
        reasons,
        ["REJECTED", "CANCELED", "BACKEND", "OTHER"],
        "{failures}"
    );
    assert_eq!(
        only("nv_inference_pending_request_count", "gauge")["value"],
        0.0
    );
    // celer's own beside them, and the process's.
    assert_eq!(family("celer_http_requests")["type"], "counter");
    assert!(only("process_resident_memory_bytes", "gauge")["value"].as_f64() > Some(0.0));
    // The parser names a counter family without its samples' `_total`.
    only("process_cpu_seconds", "counter");
    only("process_open_fds", "gauge");
    only("celer_expected_queue_wait_seconds", "gauge");
    only("celer_capacity_in_use_ratio", "gauge");
    assert!(server.stop().success());
}

/// `/metrics` as Prometheus' parser (prometheus_client, tests/metrics_scrape.py) reads it.
fn scrape(server: &Server) -> serde_json::Value {
    let out = Command::new(venv_python(&["prometheus_client"]))
        .arg(repo("tests/metrics_scrape.py"))
        .arg(server.host_port())
        .output()
        .expect("python runs");
    assert!(out.status.success(), "{}", printed(&out));
    let scraped: serde_json::Value =
        serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{e}: {}", printed(&out)));
    assert_eq!(
        scraped["content_type"],
        "text/plain; version=0.0.4; charset=utf-8"
    );
    scraped
}

#[test]
fn kserve_client_gets_the_cutout_of_invocations() {
    // Named as KServe names it: the InferenceService's name, through {{.Name}}.
    let server = Server::start(
        &model_dir("u2netp"),
        std::iter::empty::<&str>(),
        &[("CELER_MODEL_NAME", "u2netp")],
    );
    for photo in ["chelsea-exif6.jpg", "astronaut.jpg"] {
        python_client(
            &server,
            "kserve",
            "v2_kserve_client.py",
            photo,
            &["u2netp"],
            "kserve client: ok",
        );
    }
    assert!(server.stop().success());
}

#[test]
fn protocol_errors_and_the_shared_limits() {
    let server = Server::start(
        &common::fixture_dir("prob-guided"),
        ["--model-name", "matte", "--max-body-bytes", "100000"],
        &[],
    );
    let json = [("Content-Type", "application/json")];
    // Unknown model or version: 404 with {"error"}.
    for path in [
        "/v2/models/celer/infer",
        "/v2/models/matte/versions/2/infer",
    ] {
        let a = server.post(path, &json, b"{}");
        assert_eq!(a.status, 404, "{path}");
        assert!(a.json()["error"].is_string(), "{path}");
    }
    for path in ["/v2/models/matte", "/v2/models/matte/versions/1/ready"] {
        assert_eq!(server.get(path).0, 200, "{path}");
    }
    // The model's readiness names it, as KServe's servers answer (ModelReadyResponse).
    let (status, body) = server.get("/v2/models/matte/ready");
    let body: serde_json::Value = serde_json::from_slice(&body).expect("JSON");
    assert_eq!(
        (status, body),
        (200, serde_json::json!({"name": "matte", "ready": true}))
    );
    assert_eq!(server.get("/v2/models/celer").0, 404);
    // The server metadata at both spellings: `/v2`, and `/v2/` (KServe's OpenAPI).
    let (status, plain) = server.get("/v2");
    assert_eq!(status, 200);
    let plain: serde_json::Value = serde_json::from_slice(&plain).expect("JSON");
    assert!(plain["name"].is_string(), "{plain}");
    let (status, slash) = server.get("/v2/");
    assert_eq!(status, 200);
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&slash).expect("JSON"),
        plain
    );
    // Malformed requests: 400, the server stays up.
    for body in [
        &b"not json"[..],
        br#"{"inputs": []}"#,
        br#"{"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": ["%%"]}]}"#,
        br#"{"inputs": [{"name": "image_rgb", "shape": [8, 8, 3], "datatype": "UINT8", "data": [1]}]}"#,
    ] {
        let a = server.post("/v2/models/matte/infer", &json, body);
        assert_eq!(a.status, 400, "{}", String::from_utf8_lossy(body));
        assert!(a.json()["error"].is_string());
    }
    // The body limit of /invocations holds here too.
    let big = vec![b' '; 100_001];
    assert_eq!(
        server.post("/v2/models/matte/infer", &json, &big).status,
        413
    );
    // And an image inside it is served, in JSON, with the model's name.
    let png = common::png_bytes(&common::bright_rectangle(64, 48));
    let b64 = base64::engine::general_purpose::STANDARD.encode(&png);
    let body = serde_json::json!({
        "id": "one",
        "inputs": [{"name": "image", "shape": [1], "datatype": "BYTES", "data": [b64]}],
        "outputs": [{"name": "alpha"}],
    });
    let a = server.post(
        "/v2/models/matte/versions/1/infer",
        &json,
        body.to_string().as_bytes(),
    );
    assert_eq!(a.status, 200, "{}", String::from_utf8_lossy(&a.body));
    let v = a.json();
    assert_eq!(
        (v["model_name"].as_str(), v["id"].as_str()),
        (Some("matte"), Some("one"))
    );
    assert_eq!(v["outputs"][0]["shape"], serde_json::json!([48, 64]));
    assert_eq!(v["outputs"][0]["data"].as_array().unwrap().len(), 64 * 48);
    assert_eq!(server.get("/v2/health/ready").0, 200);
    assert!(server.stop().success());
}

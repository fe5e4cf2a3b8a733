//! The Kubernetes manifests under deploy/: scripts/check_manifests.py validates them
//! against the schemas of KServe's Python SDK (kserve.models) and the `kubernetes` client
//! (both in .venv from scripts/requirements-kserve.txt) and must refuse a typo; then each
//! container they define is started as written (its args and env, only the model folder,
//! address and port moved to this machine) and answers its probes and a v2 request.

mod common;
mod serve_support;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use base64::Engine;
use common::{model_dir, printed as said, repo, venv_python};
use serve_support::Server;

/// scripts/check_manifests.py with .venv's Python and `args`.
fn check_manifests(args: &[&str]) -> Output {
    Command::new(venv_python(&["kserve.models", "kubernetes.client", "yaml"]))
        .arg(repo("scripts/check_manifests.py"))
        .args(args)
        .output()
        .expect("python runs")
}

#[test]
fn manifests_fit_the_kserve_and_kubernetes_schemas() {
    let out = check_manifests(&[]);
    assert!(out.status.success(), "{}", said(&out));
    assert!(
        said(&out)
            .contains("4 manifests valid (Deployment, InferenceService, Service, ServingRuntime)"),
        "{}",
        said(&out)
    );
}

#[test]
fn the_check_refuses_typos_wrong_types_and_missing_fields() {
    // Mutations of each kind, in memory: every one refused.
    let out = check_manifests(&["--self-test"]);
    assert!(out.status.success(), "{}", said(&out));
    assert_eq!(
        said(&out).matches(": refused: ").count(),
        14,
        "{}",
        said(&out)
    );

    // And on files: a copy of deploy/ with one key misspelt fails, naming it.
    let dir = tempfile::tempdir().unwrap();
    // `from` copied into the folder, with `old` replaced by `new` once.
    let copy = |from: &str, old: &str, new: &str| {
        let to = dir.path().join(Path::new(from).file_name().unwrap());
        let text = std::fs::read_to_string(repo(from)).unwrap();
        assert!(old.is_empty() || text.contains(old), "{from} has no {old}");
        std::fs::write(to, text.replacen(old, new, 1)).unwrap();
    };
    for file in [
        "deploy/kubernetes/celer.yaml",
        "deploy/kserve/inference-service.yaml",
        "deploy/kserve/serving-runtime.yaml",
    ] {
        copy(file, "", "");
    }
    let dir_arg = dir.path().to_str().unwrap();
    let out = check_manifests(&[dir_arg]);
    assert!(out.status.success(), "the copy as it is: {}", said(&out));
    for (old, new, refusal) in [
        // A typo in a key.
        (
            "readinessProbe:",
            "readinesProbe:",
            "V1Container has no field 'readinesProbe'",
        ),
        // Valid by the schema, but not a celer that KServe can reach: bound to localhost.
        (
            "--bind=0.0.0.0",
            "--bind=127.0.0.1",
            "--bind=0.0.0.0 expected",
        ),
    ] {
        copy("deploy/kserve/serving-runtime.yaml", old, new);
        let out = check_manifests(&[dir_arg]);
        assert!(!out.status.success(), "{new} passed:\n{}", said(&out));
        assert!(said(&out).contains(refusal), "{}", said(&out));
    }
}

#[test]
fn each_manifests_container_starts_celer_and_answers_its_probes() {
    let out = check_manifests(&["--containers"]);
    assert!(out.status.success(), "{}", said(&out));
    let containers: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(containers.len(), 2, "{}", said(&out));
    let u2netp = model_dir("u2netp");
    let png = common::png_bytes(&common::bright_rectangle(64, 48));
    let body = serde_json::json!({
        "inputs": [{
            "name": "image", "shape": [1], "datatype": "BYTES",
            "data": [base64::engine::general_purpose::STANDARD.encode(&png)],
        }],
        "outputs": [{"name": "alpha"}],
    })
    .to_string();
    for c in &containers {
        let where_ = c["where"].as_str().unwrap();
        let args: Vec<String> = c["args"]
            .as_array()
            .unwrap()
            .iter()
            .map(|a| {
                let a = a.as_str().unwrap();
                // The pod's model folder, address and port, moved to this machine.
                if a.starts_with("--model-dir=") {
                    format!("--model-dir={}", u2netp.display())
                } else if a.starts_with("--bind=") {
                    "--bind=127.0.0.1".to_string()
                } else if a.starts_with("--port=") {
                    "--port=0".to_string()
                } else {
                    a.to_string()
                }
            })
            .collect();
        let model = args
            .iter()
            .find_map(|a| a.strip_prefix("--model-name="))
            .unwrap_or_else(|| panic!("{where_}: no --model-name"))
            .to_string();
        let mut command = Command::new(env!("CARGO_BIN_EXE_celer"));
        command
            .args(&args)
            .env_remove("CELER_MODEL_DIR")
            .env_remove("CELER_MODEL_NAME")
            .env_remove("SAGEMAKER_BIND_TO_PORT")
            .env_remove("CELER_HOSTING")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (name, value) in c["env"].as_object().unwrap() {
            command.env(name, value.as_str().unwrap());
        }
        let server = Server::spawn(command, Duration::from_secs(60));
        for probe in c["probes"].as_array().unwrap() {
            let probe = probe.as_str().unwrap();
            assert_eq!(server.get(probe).0, 200, "{where_}: {probe}");
        }
        assert_eq!(
            server.get(&format!("/v2/models/{model}/ready")).0,
            200,
            "{where_}"
        );
        let a = server.post(
            &format!("/v2/models/{model}/infer"),
            &[("Content-Type", "application/json")],
            body.as_bytes(),
        );
        assert_eq!(
            a.status,
            200,
            "{where_}: {}",
            String::from_utf8_lossy(&a.body)
        );
        let v = a.json();
        assert_eq!(v["model_name"], model.as_str(), "{where_}");
        assert_eq!(v["outputs"][0]["shape"], serde_json::json!([48, 64]));
        // SageMaker's caps lifted, as the manifests ask: 64 MiB bodies, any response.
        assert!(
            server
                .log()
                .contains("bodies up to 67108864 bytes, responses unlimited"),
            "{where_}:\n{}",
            server.log()
        );
        assert!(server.stop().success(), "{where_}");
    }
}

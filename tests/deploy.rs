//! The Kubernetes manifests under deploy/: scripts/check_manifests.py renders each kustomize
//! overlay (kubectl's kustomize, fetched by scripts/fetch-kubectl) and checks what it
//! renders against kubernetes-validate's strict schemas, KServe's Python SDK models and the
//! `kubernetes` client's (all in .venv from scripts/requirements-kserve.txt), then a policy
//! of restricted pods, drain and Knative rules; it must refuse mutations of each. Then
//! each container the overlays define is started as rendered (its args and env, only the
//! model folder, address and ports moved to this machine), answers its probes, gRPC's
//! health check as Kubernetes' gRPC probe calls it and a v2 request, and drains on SIGTERM
//! where its manifest says so.

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
    Command::new(venv_python(&[
        "kserve.models",
        "kubernetes.client",
        "kubernetes_validate",
        "yaml",
    ]))
    .arg(repo("scripts/check_manifests.py"))
    .args(args)
    .output()
    .expect("python runs")
}

/// `from` copied into `to`, folders and files.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).unwrap();
        }
    }
}

#[test]
fn overlays_render_and_pass_the_schemas_and_the_policy() {
    let out = check_manifests(&[]);
    assert!(out.status.success(), "{}", said(&out));
    for part in [
        "4 manifests valid (Deployment, InferenceService, Service, ServingRuntime) \
         from deploy/overlays/kserve, deploy/overlays/kubernetes",
        "kubernetes-validate --strict at 1.30 and 1.37",
        "restricted-pod policy on 2 pods",
    ] {
        assert!(said(&out).contains(part), "{part}:\n{}", said(&out));
    }
}

#[test]
fn the_check_refuses_typos_insecure_pods_and_what_knative_refuses() {
    // Mutations of each rendered kind, in memory: every one refused.
    let out = check_manifests(&["--self-test"]);
    let text = said(&out);
    assert!(out.status.success(), "{text}");
    assert_eq!(text.matches(": refused: ").count(), 46, "{text}");
    assert!(text.contains("self-test: 46 mutations"), "{text}");
    for (case, because) in [
        (
            "ServingRuntime seccompProfile dropped",
            "seccompProfile.type must be RuntimeDefault",
        ),
        (
            "Deployment seccompProfile dropped",
            "seccompProfile.type must be RuntimeDefault",
        ),
        (
            "InferenceService terminationGracePeriodSeconds in Knative mode",
            "refused in Knative mode",
        ),
        (
            "ServingRuntime preStop in Knative mode",
            "lifecycle is refused in Knative mode",
        ),
        (
            "Deployment grace shorter than preStop + drain + shutdown grace",
            "= 35 s",
        ),
        (
            "Deployment field newer than Kubernetes 1.30",
            "(kubernetes-validate --strict at 1.30)",
        ),
        (
            "ServingRuntime field newer than Kubernetes 1.30",
            "(kubernetes-validate --strict, container at 1.30)",
        ),
        (
            "Service grpc targetPort on REST's port",
            "not celer's gRPC port 8001",
        ),
        (
            "Service grpc port removed",
            "no port targets celer's gRPC port 8001",
        ),
        (
            "Deployment gRPC port moved alone",
            "a port named grpc on celer's gRPC port 9001",
        ),
        (
            "ServingRuntime grpc-v2 with gRPC off",
            "protocolVersions lists grpc-v2, but",
        ),
        (
            "InferenceService grpc-v2 in Knative mode",
            "Knative routes one port",
        ),
    ] {
        let line = text
            .lines()
            .find(|l| l.starts_with(&format!("self-test: {case}: refused: ")))
            .unwrap_or_else(|| panic!("{case} not refused:\n{text}"));
        assert!(line.contains(because), "{line}");
    }

    // And on files: a copy of deploy/ with one file changed fails, naming what is wrong.
    let dir = tempfile::tempdir().unwrap();
    let copy = dir.path().join("deploy");
    copy_tree(&repo("deploy"), &copy);
    let copy_arg = copy.to_str().unwrap();
    let out = check_manifests(&[copy_arg]);
    assert!(out.status.success(), "the copy as it is: {}", said(&out));
    // `file` (under deploy/) with each `old` replaced by its `new` once, checked, then
    // restored.
    let check_edited = |file: &str, edits: &[(&str, &str)], args: &[&str]| -> Output {
        let path = copy.join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        let mut edited = text.clone();
        for (old, new) in edits {
            assert!(edited.contains(old), "{file} has no {old}");
            edited = edited.replacen(old, new, 1);
        }
        std::fs::write(&path, edited).unwrap();
        let out = check_manifests(&[args, &[copy_arg]].concat());
        std::fs::write(&path, text).unwrap();
        out
    };
    let check_with = |file: &str, old: &str, new: &str, args: &[&str]| -> Output {
        check_edited(file, &[(old, new)], args)
    };
    for (file, old, new, refusal) in [
        // A typo in a key of the shared container: both overlays render it.
        (
            "base/celer.yaml",
            "\n        readinessProbe:",
            "\n        readinesProbe:",
            "V1Container has no field 'readinesProbe'",
        ),
        // Valid by the schema, but not a celer that KServe can reach: bound to localhost.
        (
            "base/celer.yaml",
            "--bind=0.0.0.0",
            "--bind=127.0.0.1",
            "--bind=0.0.0.0 expected",
        ),
        // Restricted pods: the seccomp profile dropped.
        (
            "base/celer.yaml",
            "          seccompProfile:\n            type: RuntimeDefault\n",
            "",
            "securityContext.seccompProfile.type must be RuntimeDefault (restricted), got None",
        ),
        // Knative refuses a pod's terminationGracePeriodSeconds.
        (
            "overlays/kserve/inference-service.yaml",
            "    minReplicas: 1\n",
            "    minReplicas: 1\n    terminationGracePeriodSeconds: 30\n",
            "spec.predictor.terminationGracePeriodSeconds is refused in Knative mode",
        ),
        // An overlay kustomize cannot render.
        (
            "overlays/kubernetes/kustomization.yaml",
            "  - ../../base\n",
            "  - ../../no-such-base\n",
            "deploy/overlays/kubernetes: kustomize failed",
        ),
        // The Service's gRPC port aimed at REST's.
        (
            "overlays/kubernetes/service.yaml",
            "targetPort: grpc",
            "targetPort: http",
            "port grpc targets 'http' = 8080, not celer's gRPC port 8001",
        ),
        // gRPC moved in the shared container, not in the Deployment's ports.
        (
            "base/celer.yaml",
            "value: \"8001\"",
            "value: \"8002\"",
            "a port named grpc on celer's gRPC port 8002 (CELER_GRPC_PORT) expected, got 8001",
        ),
        // The runtime serves gRPC but does not say so to KServe.
        (
            "overlays/kserve/serving-runtime.yaml",
            "    - grpc-v2\n",
            "",
            "serves gRPC on 8001: protocolVersions should list grpc-v2",
        ),
    ] {
        let out = check_with(file, old, new, &[]);
        assert!(
            !out.status.success(),
            "{file}: {new} passed:\n{}",
            said(&out)
        );
        assert!(
            said(&out).contains(refusal),
            "{file}: {new}:\n{}",
            said(&out)
        );
    }

    // gRPC on KServe as serving-runtime.yaml describes it: an InferenceService in Standard
    // mode on grpc-v2, its predictor given the port named grpc. The gRPC rules accept it;
    // what is left is Standard mode's drain, which the runtime (written for Knative) lacks.
    let out = check_edited(
        "overlays/kserve/inference-service.yaml",
        &[
            (
                "\n    serving.kserve.io/deploymentMode: Serverless",
                "\n    serving.kserve.io/deploymentMode: Standard",
            ),
            (
                "      protocolVersion: v2\n",
                "      protocolVersion: grpc-v2\n      ports:\n        - name: grpc\n          \
                 containerPort: 8001\n          protocol: TCP\n",
            ),
        ],
        &[],
    );
    let text = said(&out);
    assert!(!out.status.success(), "{text}");
    assert!(
        text.contains("CELER_DRAIN_S of at least 1 expected"),
        "{text}"
    );
    assert!(!text.contains("grpc") && !text.contains("gRPC"), "{text}");

    // The image is named once, in the base, for both overlays.
    let out = check_with(
        "base/kustomization.yaml",
        "newName: registry.example.com/celer",
        "newName: example.org/team/celer",
        &["--containers"],
    );
    assert!(out.status.success(), "{}", said(&out));
    let containers: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(containers.len(), 2, "{}", said(&out));
    for c in &containers {
        assert_eq!(c["image"], "example.org/team/celer:gpu", "{c}");
    }
}

/// The paragraph of `celer serve --help` about one option.
fn help_of(help: &str, option: &str) -> String {
    let at = help
        .find(&format!("\n      {option} "))
        .unwrap_or_else(|| panic!("{option} is not in `celer serve --help`:\n{help}"));
    let rest = &help[at + 1..];
    rest[..rest.find("\n\n").unwrap_or(rest.len())].to_string()
}

#[test]
fn the_manifests_numbers_are_celers_defaults() {
    // containerConcurrency and scaleTarget (overlays/kserve) and the termination grace
    // (overlays/kubernetes) are derived by scripts/check_manifests.py from these defaults;
    // the gRPC port the manifests expose is celer's default.
    let out = Command::new(env!("CARGO_BIN_EXE_celer"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", said(&out));
    let help = String::from_utf8_lossy(&out.stdout);
    for (option, default, constant) in [
        ("--replicas", "on a GPU, 2 ", "GPU_REPLICAS"),
        ("--queue-capacity", "[default: 16]", "QUEUE_CAPACITY"),
        (
            "--max-queue-wait",
            "Default: `2x`",
            "QUEUE_WAIT_SERVICE_TIMES",
        ),
        ("--shutdown-grace-s", "[default: 25]", "SHUTDOWN_GRACE_S"),
        ("--grpc-port", "[default: 8001]", "GRPC_PORT"),
    ] {
        let text = help_of(&help, option);
        assert!(
            text.contains(default),
            "{option} no longer says {default:?}: update {constant} in \
             scripts/check_manifests.py and the manifests' arithmetic:\n{text}"
        );
    }
}

/// gRPC's health check of `service` at `address`, as Kubernetes' gRPC probe makes it
/// (grpc.health.v1.Health/Check, called with .venv's grpcio on raw bytes: the request
/// `{service}` and the reply `{status}` encoded by hand): SERVING, NOT_SERVING, ...
fn grpc_health(address: &str, service: &str) -> String {
    const CHECK: &str = r#"
import sys, grpc
request = sys.argv[2].encode()
request = (b"\x0a" + bytes([len(request)]) + request) if request else b""
channel = grpc.insecure_channel(sys.argv[1])
check = channel.unary_unary("/grpc.health.v1.Health/Check")
reply = check(request, timeout=10)
names = {b"": "UNKNOWN", b"\x08\x01": "SERVING", b"\x08\x02": "NOT_SERVING"}
print(names.get(reply, repr(reply)))
"#;
    let out = Command::new(venv_python(&["grpc"]))
        .args(["-c", CHECK, address, service])
        .output()
        .expect("python runs");
    assert!(
        out.status.success(),
        "gRPC health of {address}: {}",
        said(&out)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A port no one listens on now, for a server of this test's to take.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[test]
fn each_overlays_container_starts_celer_and_answers_its_probes() {
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
                } else if a.starts_with("--grpc-port=") {
                    panic!("{where_}: --grpc-port in args: the manifests set CELER_GRPC_PORT")
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
            .env_remove("CELER_DRAIN_S")
            .env_remove("CELER_SHUTDOWN_GRACE_S")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        for (name, value) in c["env"].as_object().unwrap() {
            command.env(name, value.as_str().unwrap());
        }
        // The manifests serve gRPC on celer's 8001 (scripts/check_manifests.py checks it
        // against the ports exposed); here, where tests run side by side, on a free port.
        assert_eq!(c["grpc_port"], 8001, "{where_}");
        let grpc_port = free_port();
        command.env("CELER_GRPC_PORT", grpc_port.to_string());
        let grpc = format!("127.0.0.1:{grpc_port}");
        let server = Server::spawn(command, Duration::from_secs(60));
        for probe in c["probes"].as_array().unwrap() {
            let probe = probe.as_str().unwrap();
            assert_eq!(server.get(probe).0, 200, "{where_}: {probe}");
        }
        // The gRPC readiness probe the manifests offer instead: the same answer.
        assert!(
            server.log().contains(&format!("grpc_address={grpc}")),
            "{where_}:\n{}",
            server.log()
        );
        assert_eq!(grpc_health(&grpc, ""), "SERVING", "{where_}");
        assert_eq!(
            grpc_health(&grpc, "inference.GRPCInferenceService"),
            "SERVING",
            "{where_}"
        );
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
        // The drain the manifest asks for (plain Kubernetes): after SIGTERM, readiness
        // says 503 while requests are still answered.
        let drain_s: u64 = c["env"]["CELER_DRAIN_S"]
            .as_str()
            .map_or(0, |s| s.parse().unwrap());
        if drain_s > 0 {
            server.terminate();
            // Readiness turns once the signal is handled.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while server.get("/v2/health/ready").0 != 503 && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            assert_eq!(server.get("/v2/health/ready").0, 503, "{where_}: draining");
            assert_eq!(grpc_health(&grpc, ""), "NOT_SERVING", "{where_}: draining");
            let a = server.post(
                &format!("/v2/models/{model}/infer"),
                &[("Content-Type", "application/json")],
                body.as_bytes(),
            );
            assert_eq!(a.status, 200, "{where_}: an infer while draining");
            assert!(server.wait().success(), "{where_}");
        } else {
            assert!(server.stop().success(), "{where_}");
        }
    }
}

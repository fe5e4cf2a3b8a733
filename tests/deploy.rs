//! The Kubernetes manifests under deploy/: scripts/check_manifests.py renders each kustomize
//! overlay (kubectl's kustomize, fetched by scripts/fetch-kubectl) and checks what it
//! renders against kubernetes-validate's strict schemas, KServe's Python SDK models and the
//! `kubernetes` client's (all in .venv from scripts/requirements-kserve.txt), then a policy
//! of restricted pods, drain and Knative rules; it must refuse mutations of each. Then
//! each container the overlays define is started as rendered (its args and env, only the
//! model folder, address and port moved to this machine), answers its probes and a v2
//! request, and drains on SIGTERM where its manifest says so.

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
    assert_eq!(text.matches(": refused: ").count(), 36, "{text}");
    assert!(text.contains("self-test: 36 mutations"), "{text}");
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
    // `file` (under deploy/) with `old` replaced by `new` once, checked, then restored.
    let check_with = |file: &str, old: &str, new: &str, args: &[&str]| -> Output {
        let path = copy.join(file);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(old), "{file} has no {old}");
        std::fs::write(&path, text.replacen(old, new, 1)).unwrap();
        let out = check_manifests(&[args, &[copy_arg]].concat());
        std::fs::write(&path, text).unwrap();
        out
    };
    for (file, old, new, refusal) in [
        // A typo in a key of the shared container: both overlays render it.
        (
            "base/celer.yaml",
            "readinessProbe:",
            "readinesProbe:",
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
    // (overlays/kubernetes) are derived by scripts/check_manifests.py from these defaults.
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
    ] {
        let text = help_of(&help, option);
        assert!(
            text.contains(default),
            "{option} no longer says {default:?}: update {constant} in \
             scripts/check_manifests.py and the manifests' arithmetic:\n{text}"
        );
    }
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

//! `celer build` and `celer inspect` as a user runs them on a machine without a GPU:
//! the binary validates the pipeline's models with ONNX Runtime, reports their I/O and
//! the shapes a GPU build would use, says that no GPU was found, and succeeds; an engine
//! folder is inspected through its manifest. The CUDA driver is hidden from the binary
//! (CELER_LIBCUDA_PATH points nowhere), so the test means the same on a GPU machine.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use celer::engines::manifest::{
    engine_dir, sha256_bytes, BuildRecord, EngineManifest, GpuIdentity, ENGINES_DIR, MANIFEST_FILE,
    MANIFEST_FORMAT,
};
use celer::tensorrt::{DataType, Precision, TensorDesc};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

fn celer(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_celer"))
        .args(args)
        // The checkout's .venv holds ONNX Runtime; the binary finds it from here.
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("CELER_LIBCUDA_PATH", "/nonexistent/libcuda.so.1")
        .env("CELER_LOG", "warn")
        .output()
        .expect("the celer binary runs")
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn require_u2netp() {
    assert!(
        repo("onnx/u2netp/u2netp.onnx").is_file(),
        "onnx/u2netp/u2netp.onnx is missing: run `make models`"
    );
}

#[test]
fn build_without_a_gpu_validates_the_models_and_succeeds() {
    require_u2netp();
    let engines = tempfile::tempdir().unwrap();
    let out = celer(&[
        "build",
        "--model-dir",
        "onnx/u2netp",
        "--engines-dir",
        engines.path().to_str().unwrap(),
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("model segmentation.model"), "{stdout}");
    assert!(stdout.contains("input  input.1"), "{stdout}");
    assert!(stdout.contains("1x3x320x320"), "{stdout}");
    assert!(stdout.contains("output 1959"), "{stdout}");
    assert!(stdout.contains("profile: static shapes"), "{stdout}");
    assert!(
        stdout.contains("ONNX Runtime: every model loads and fits"),
        "{stdout}"
    );
    assert!(stdout.contains("no NVIDIA GPU found"), "{stdout}");
    assert!(
        stdout.contains("no CUDA driver"),
        "the reason is given: {stdout}"
    );
    assert!(stdout.contains("no TensorRT engines built"), "{stdout}");
    let written: Vec<_> = std::fs::read_dir(engines.path()).unwrap().collect();
    assert!(written.is_empty(), "nothing is written without a GPU");
}

#[test]
fn build_refuses_a_batch_range_the_model_cannot_take() {
    require_u2netp();
    let out = celer(&["build", "--model-dir", "onnx/u2netp", "--batch", "1:4:8"]);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}");
    assert!(stderr.contains("fixed batch of 1"), "{stderr}");
    assert!(stderr.contains("u2netp.onnx"), "{stderr}");
}

#[test]
fn build_of_a_two_model_pipeline_checks_both() {
    let out = celer(&["build", "--model-dir", "onnx/fixtures/classes-matting"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("model segmentation.model"), "{stdout}");
    assert!(stdout.contains("model matting.model"), "{stdout}");
    // The fixtures have a dynamic batch: batch 1 by default, sizes from celer.toml.
    assert!(
        stdout.contains("profile trimap: min 1x1x64x64 opt 1x1x64x64 max 1x1x64x64"),
        "{stdout}"
    );
    assert!(stdout.contains("no NVIDIA GPU found"), "{stdout}");

    let out = celer(&[
        "build",
        "--model-dir",
        "onnx/fixtures/classes-matting",
        "--batch",
        "1:4:8",
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(
        stdout.contains("profile image: min 1x3x64x64 opt 4x3x64x64 max 8x3x64x64"),
        "{stdout}"
    );
}

#[test]
fn inspect_shows_an_engine_manifest() {
    let dir = tempfile::tempdir().unwrap();
    let gpu = GpuIdentity {
        name: "NVIDIA H200".into(),
        compute_capability: "9.0".into(),
    };
    let engine = engine_dir(&dir.path().join(ENGINES_DIR), "u2netp", &gpu);
    std::fs::create_dir_all(&engine).unwrap();
    std::fs::write(engine.join("u2netp.plan"), b"not a real plan").unwrap();
    let manifest = EngineManifest {
        format: MANIFEST_FORMAT,
        model: "u2netp".into(),
        onnx_file: "u2netp.onnx".into(),
        onnx_sha256: "0".repeat(64),
        plan_file: "u2netp.plan".into(),
        plan_sha256: sha256_bytes(b"not a real plan"),
        plan_bytes: 15,
        tensorrt_version: "10.16.0".parse().unwrap(),
        cuda_driver_version: Some("12.8".into()),
        gpu,
        precision: Precision::Fp16,
        profile: vec![],
        inputs: vec![TensorDesc {
            name: "input.1".into(),
            is_input: true,
            data_type: DataType::Float,
            shape: vec![1, 3, 320, 320],
        }],
        outputs: vec![TensorDesc {
            name: "1959".into(),
            is_input: false,
            data_type: DataType::Float,
            shape: vec![1, 1, 320, 320],
        }],
        build: BuildRecord {
            celer_version: "0.1.0".into(),
            built_at_unix_s: 0,
            build_seconds: 41.5,
            workspace_mib: Some(2048),
            timing_cache: Some("timing-cache/nvidia-h200-sm90-trt10.16.0.cache".into()),
            tensorrt_library: "/usr/lib/x86_64-linux-gnu/libnvinfer.so.10".into(),
        },
    };
    manifest.write(&engine.join(MANIFEST_FILE)).unwrap();

    for target in [
        engine.clone(),
        engine.join("u2netp.plan"),
        engine.join(MANIFEST_FILE),
    ] {
        let out = celer(&["inspect", target.to_str().unwrap()]);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
        assert!(
            stdout.contains("NVIDIA H200 (compute capability 9.0)"),
            "{stdout}"
        );
        assert!(stdout.contains("tensorrt     10.16.0"), "{stdout}");
        assert!(stdout.contains("precision    fp16"), "{stdout}");
        assert!(stdout.contains("input  input.1"), "{stdout}");
        assert!(stdout.contains("workspace 2048 MiB"), "{stdout}");
        // No TensorRT (or no such GPU) here: the manifest is shown, the live I/O is not,
        // and the reason is given.
        assert!(
            stdout.contains("engine I/O from TensorRT: not shown ("),
            "{stdout}"
        );
    }
}

#[test]
fn inspect_of_a_model_dir_lists_its_engines() {
    let out = celer(&["inspect", "onnx/fixtures/prob-guided"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
    assert!(stdout.contains("engines: none in"), "{stdout}");
    assert!(stdout.contains("`celer build` makes them"), "{stdout}");
}

#[test]
fn inspect_describes_the_pipeline_in_words() {
    for (dir, says) in [
        (
            "onnx/fixtures/prob-guided",
            "guided filter of the mask by the image's luma",
        ),
        (
            "onnx/fixtures/classes-matting",
            "class scores, argmax mapped to the trimap",
        ),
    ] {
        let out = celer(&["inspect", dir]);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "stdout:\n{stdout}\nstderr:\n{stderr}");
        assert!(stdout.contains(says), "{stdout}");
        assert!(
            stdout.contains("  trimap        foreground at >="),
            "{stdout}"
        );
        // Not Rust's Debug form of the description.
        assert!(!stdout.contains("Spec {"), "{stdout}");
    }
}

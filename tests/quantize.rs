//! Reduced-precision variants as a user makes and serves them: `celer build --precision
//! int8|fp16` on the fixture pipeline (a 1x1 convolution and a sigmoid, refined by the
//! guided filter) with folders of generated images, the gate refusing a variant
//! calibrated on blank images, and `celer serve` running the INT8 variant only while its
//! manifest records a passed gate (and never with `--fp32`). The CUDA driver is hidden
//! from the binary, so the test means the same on a GPU machine.

mod common;
mod serve_support;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use celer::quantize::variant::{VariantManifest, VARIANT_MANIFEST};
use celer::quantize::weights::WeightBits;
use celer::spec::ModelPrecision;
use image::{Rgb, RgbImage};
use serve_support::Server;

const NO_GPU: (&str, &str) = ("CELER_LIBCUDA_PATH", "/nonexistent/libcuda.so.1");

fn celer(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_celer"))
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env(NO_GPU.0, NO_GPU.1)
        .env("CELER_LOG", "warn")
        .output()
        .expect("the celer binary runs")
}

/// The fixture pipeline copied into a folder of its own (the build writes engines/ there).
fn model_dir(root: &Path) -> PathBuf {
    let dir = root.join("model");
    std::fs::create_dir_all(&dir).expect("model dir");
    std::fs::copy(
        common::repo("onnx/fixtures/prob.onnx"),
        dir.join("prob.onnx"),
    )
    .expect("copy");
    let toml = std::fs::read_to_string(common::fixture_dir("prob-guided").join("celer.toml"))
        .expect("fixture toml")
        .replace("model = \"../prob.onnx\"", "model = \"prob.onnx\"");
    std::fs::write(dir.join("celer.toml"), toml).expect("toml");
    dir
}

/// A dark image with a bright rectangle at (x0, y0) of `w` x `h`, and a gradient behind
/// it, so that the model's input and output cover their ranges.
fn scene(size: u32, x0: u32, y0: u32, w: u32, h: u32, tint: u8) -> RgbImage {
    RgbImage::from_fn(size, size, |x, y| {
        let inside = (x0..x0 + w).contains(&x) && (y0..y0 + h).contains(&y);
        if inside {
            Rgb([230, 225u8.saturating_sub(tint), 220])
        } else {
            let g = ((x + y) * 60 / (2 * size)) as u8;
            Rgb([g + tint / 4, g, 30])
        }
    })
}

fn write_images(dir: &Path, images: &[RgbImage]) {
    std::fs::create_dir_all(dir).expect("image dir");
    for (i, im) in images.iter().enumerate() {
        im.save(dir.join(format!("{i:02}.png"))).expect("png");
    }
}

/// Calibration and validation folders of different scenes.
fn photo_folders(root: &Path) -> (PathBuf, PathBuf) {
    let (calibration, validation) = (root.join("calibration"), root.join("validation"));
    write_images(
        &calibration,
        &[
            scene(96, 10, 10, 40, 50, 0),
            scene(120, 30, 20, 60, 70, 20),
            scene(80, 5, 30, 50, 30, 40),
            scene(100, 40, 40, 50, 50, 10),
        ],
    );
    write_images(
        &validation,
        &[
            scene(110, 20, 35, 55, 45, 30),
            scene(90, 35, 5, 40, 60, 5),
            scene(128, 50, 50, 60, 40, 15),
        ],
    );
    (calibration, validation)
}

fn int8_build(model: &Path, calibration: &Path, validation: &Path, extra: &[&str]) -> Output {
    let mut args = vec![
        "build",
        "--model-dir",
        model.to_str().expect("utf-8"),
        "--precision",
        "int8",
        "--calibration",
        calibration.to_str().expect("utf-8"),
        "--validation",
        validation.to_str().expect("utf-8"),
    ];
    args.extend_from_slice(extra);
    celer(&args)
}

fn variant(model: &Path, precision: ModelPrecision) -> PathBuf {
    model.join("engines/prob").join(precision.as_str())
}

fn manifest(model: &Path, precision: ModelPrecision) -> VariantManifest {
    VariantManifest::read(&variant(model, precision))
        .expect("a readable manifest")
        .expect("a manifest")
}

#[test]
fn an_int8_variant_of_the_fixture_passes_its_gate_and_records_how() {
    let root = tempfile::tempdir().expect("tempdir");
    let model = model_dir(root.path());
    let (calibration, validation) = photo_folders(root.path());
    let out = int8_build(
        &model,
        &calibration,
        &validation,
        &["--calibration-method", "minmax"],
    );
    let text = common::printed(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("gate on the validation images"), "{text}");
    let m = manifest(&model, ModelPrecision::Int8);
    assert_eq!(m.precision, ModelPrecision::Int8);
    assert_eq!(m.source_file, "prob.onnx");
    assert_eq!((m.opset_from, m.opset_to), (17, 17));
    assert_eq!(m.quantized_nodes, 1, "the fixture's one convolution");
    assert_eq!(
        m.weights,
        Some(WeightBits::for_this_cpu()),
        "the width this CPU runs without saturating"
    );
    assert_eq!(
        m.rewrites,
        Some(vec![
            "Conv_0: three input channels, padded to four".to_string()
        ]),
        "the fixture's convolution reads the image"
    );
    let cal = m.calibration.as_ref().expect("calibration recorded");
    assert_eq!(cal.images.len(), 4);
    assert_eq!(cal.method.to_string(), "minmax");
    let gate = m.gate.as_ref().expect("gate figures");
    assert!(gate.passed);
    assert_eq!(gate.images.len(), 3, "one row per validation image");
    assert!(gate.overall.iou >= 0.98 && gate.overall.mean_abs_diff <= 2.0);
    assert!(variant(&model, ModelPrecision::Int8)
        .join(&m.variant_file)
        .is_file());
    assert!(
        !variant(&model, ModelPrecision::Int8).join(".work").exists(),
        "the build's work files are gone"
    );

    // The variant is a QDQ model: 8-bit weights behind a DequantizeLinear.
    let q = celer::quantize::model::OnnxModel::load(
        &variant(&model, ModelPrecision::Int8).join(&m.variant_file),
    )
    .expect("the variant reads");
    let ops: Vec<String> = q.nodes.iter().map(|n| n.op_type()).collect();
    assert!(ops.contains(&"QuantizeLinear".to_string()), "{ops:?}");
    assert!(ops.contains(&"DequantizeLinear".to_string()), "{ops:?}");

    // Run again: the current variant is kept, not made again.
    let again = int8_build(&model, &calibration, &validation, &[]);
    let text = common::printed(&again);
    assert!(again.status.success(), "{text}");
    assert!(text.contains("current"), "{text}");
    assert_eq!(manifest(&model, ModelPrecision::Int8), m);

    // A variant made before the split (its manifest has no record of it) is made again.
    let dir = variant(&model, ModelPrecision::Int8);
    let mut older = m.clone();
    older.rewrites = None;
    older.write(&dir).expect("manifest written");
    let again = int8_build(
        &model,
        &calibration,
        &validation,
        &["--calibration-method", "minmax"],
    );
    let text = common::printed(&again);
    assert!(again.status.success(), "{text}");
    assert!(!text.contains("current"), "{text}");
    assert_eq!(manifest(&model, ModelPrecision::Int8).rewrites, m.rewrites);

    // `celer inspect` shows the precision each device runs and the gate's table.
    let out = celer(&["inspect", model.to_str().expect("utf-8")]);
    let text = common::printed(&out);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("precision on cpu: segmentation int8"),
        "{text}"
    );
    assert!(
        text.contains("precision on gpu: segmentation fp32"),
        "{text}"
    );
    assert!(
        text.contains("gate: IoU >= 0.98 and mean |Δα| <= 2/255: passed"),
        "{text}"
    );
}

#[test]
fn ranges_from_blank_images_are_refused_by_the_gate() {
    let root = tempfile::tempdir().expect("tempdir");
    let model = model_dir(root.path());
    let (_, validation) = photo_folders(root.path());
    let blank = root.path().join("blank");
    write_images(&blank, &[RgbImage::new(64, 64), RgbImage::new(80, 80)]);
    for extra in [&[][..], &["--no-search"][..]] {
        let out = int8_build(&model, &blank, &validation, extra);
        let text = common::printed(&out);
        assert!(!out.status.success(), "{extra:?}: built anyway:\n{text}");
        assert!(
            text.contains("below the quality gate") || text.contains("within the gate"),
            "{extra:?}: {text}"
        );
        let dir = variant(&model, ModelPrecision::Int8);
        assert!(
            !dir.join(VARIANT_MANIFEST).exists(),
            "{extra:?}: a manifest was written"
        );
        assert!(
            !dir.join("prob.int8.onnx").exists(),
            "{extra:?}: a variant was written"
        );
    }
}

#[test]
fn a_validation_image_that_is_a_calibration_image_is_refused() {
    let root = tempfile::tempdir().expect("tempdir");
    let model = model_dir(root.path());
    let (calibration, _) = photo_folders(root.path());
    let out = int8_build(&model, &calibration, &calibration, &[]);
    let text = common::printed(&out);
    assert!(!out.status.success(), "{text}");
    assert!(text.contains("held-out"), "{text}");
}

#[test]
fn an_fp16_variant_keeps_a_float32_interface_and_passes_its_gate() {
    let root = tempfile::tempdir().expect("tempdir");
    let model = model_dir(root.path());
    let (_, validation) = photo_folders(root.path());
    let out = celer(&[
        "build",
        "--model-dir",
        model.to_str().expect("utf-8"),
        "--precision",
        "fp16",
        "--validation",
        validation.to_str().expect("utf-8"),
    ]);
    let text = common::printed(&out);
    assert!(out.status.success(), "{text}");
    let m = manifest(&model, ModelPrecision::Fp16);
    assert!(m.gate.as_ref().is_some_and(|g| g.passed));
    let half = celer::quantize::model::OnnxModel::load(
        &variant(&model, ModelPrecision::Fp16).join(&m.variant_file),
    )
    .expect("the variant reads");
    assert!(
        half.initializers.iter().all(|i| i.data_type() == 10),
        "float16 weights"
    );
    assert_eq!(half.float_input_names().expect("inputs"), vec!["image"]);
    // The CPU serves no FP16 (slower than FP32 there): inspect says fp32 on the CPU.
    let out = celer(&["inspect", model.to_str().expect("utf-8")]);
    let text = common::printed(&out);
    assert!(
        text.contains("precision on cpu: segmentation fp32"),
        "{text}"
    );
    assert!(
        text.contains("precision on gpu: segmentation fp16"),
        "{text}"
    );
}

/// One request, then the model stage's count in `/metrics` by precision.
fn model_stage_precision(server: &Server) -> String {
    let body = common::png_bytes(&scene(100, 20, 20, 50, 50, 0));
    let answer = server.post("/invocations", &[("Content-Type", "image/png")], &body);
    assert_eq!(answer.status, 200, "{}", server.log());
    let (_, metrics) = server.get("/metrics");
    let metrics = String::from_utf8_lossy(&metrics).into_owned();
    metrics
        .lines()
        .find(|l| l.starts_with("celer_inference_model_stage_duration_us_count{"))
        .and_then(|l| l.split("precision=\"").nth(1))
        .and_then(|rest| rest.split('"').next())
        .unwrap_or_else(|| panic!("no model stage by precision in:\n{metrics}"))
        .to_string()
}

#[test]
fn serve_runs_the_variant_that_passed_and_falls_back_to_fp32_otherwise() {
    let root = tempfile::tempdir().expect("tempdir");
    let model = model_dir(root.path());
    let (calibration, validation) = photo_folders(root.path());
    let out = int8_build(&model, &calibration, &validation, &[]);
    assert!(out.status.success(), "{}", common::printed(&out));
    let env = [NO_GPU, ("CELER_DEVICES", "cpu"), ("CELER_FP32", "0")];

    let server = Server::start(&model, ["--replicas", "1"], &env);
    assert_eq!(model_stage_precision(&server), "int8");
    assert!(
        server.log().contains("segmentation int8 (prob.int8.onnx"),
        "{}",
        server.log()
    );
    server.stop_cleanly();

    let server = Server::start(&model, ["--replicas", "1", "--fp32"], &env);
    assert_eq!(model_stage_precision(&server), "fp32");
    assert!(server.log().contains("FP32 forced"), "{}", server.log());
    server.stop_cleanly();

    // A manifest without the gate's figures serves nothing.
    let dir = variant(&model, ModelPrecision::Int8);
    let mut m = manifest(&model, ModelPrecision::Int8);
    m.gate = None;
    m.write(&dir).expect("manifest written");
    let server = Server::start(&model, ["--replicas", "1"], &env);
    assert_eq!(model_stage_precision(&server), "fp32");
    assert!(
        server.log().contains("records no gate figures"),
        "{}",
        server.log()
    );
    server.stop_cleanly();
}

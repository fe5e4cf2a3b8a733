//! What the TensorRT engine tests share: an engine built from each model of a pipeline
//! on GPU 0 with `engines::store`, served by `GpuStages`, against the same pipeline with
//! ONNX Runtime for the models (tests/tensorrt_engine.rs, tests/tensorrt_engine_isnet.rs).
#![allow(dead_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use celer::cuda::trt_context::TrtContext;
use celer::cuda::GpuDevice;
use celer::engines::store::{build_and_store, BuildOptions, EngineStore, ModelFile};
use celer::matte::{Planes, StageTimings};
use celer::replica::gpu::{GpuError, GpuLimits, GpuStages, ModelSource};
use celer::spec::{PipelineSpec, MATTING_MODEL, SEGMENTATION_MODEL};
use celer::tensorrt::{Engine, Precision, TensorRt};
use image::RgbImage;

use super::{gpu_support, trt_support};

/// A file of the repository (`CELER_REPO_ROOT` where the tests run from a packed copy,
/// as `make gpu-check` runs them).
pub fn repo(path: &str) -> PathBuf {
    std::env::var_os("CELER_REPO_ROOT")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")))
        .join(path)
}

/// GPU 0 and TensorRT with its parser; the test fails, saying which is missing.
fn gpu_and_tensorrt() -> (Arc<GpuDevice>, TensorRt) {
    (gpu_support::gpu(), trt_support::builder())
}

fn photos() -> Vec<(String, RgbImage)> {
    ["astronaut.png", "photo-1920x1080.jpg", "chelsea-exif6.jpg"]
        .iter()
        .filter_map(|name| {
            image::open(repo("tests/data/fetched").join(name))
                .ok()
                .map(|i| (name.to_string(), i.into_rgb8()))
        })
        .collect()
}

/// Mean |a - b| in 1/255 units, and the IoU of `> 127`.
fn agreement(a: &[u8], b: &[u8]) -> (f64, f64) {
    let mean = a
        .iter()
        .zip(b)
        .map(|(x, y)| f64::from(x.abs_diff(*y)))
        .sum::<f64>()
        / a.len().max(1) as f64;
    let (mut both, mut either) = (0u64, 0u64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (*x > 127, *y > 127);
        both += u64::from(x && y);
        either += u64::from(x || y);
    }
    let iou = if either == 0 {
        1.0
    } else {
        both as f64 / either as f64
    };
    (mean, iou)
}

/// Builds every model of the pipeline in `model_dir` into engines (fp32 and fp16 on
/// TensorRT 10, the model's own precision on 11), serves the test photos from them, and
/// holds the alpha to the ONNX Runtime pipeline's: fp32 mean |difference| <= 0.5/255 and
/// IoU of alpha > 127 >= 0.999, fp16 mean <= 2/255 and IoU >= 0.99.
pub fn engines_match_onnx_runtime(model_dir: &Path) {
    let test = format!("TensorRT engines of {}", model_dir.display());
    let spec = PipelineSpec::load_dir(model_dir)
        .unwrap_or_else(|e| panic!("{test}: the pipeline description: {e}"));
    for (key, path) in spec.model_keys() {
        assert!(
            path.is_file(),
            "{test}: {} (`{key}`) is missing: `make models` (ISNet: `make models-all`)",
            path.display()
        );
    }
    let (device, trt) = gpu_and_tensorrt();
    device.context().bind_to_thread().unwrap();
    let photos = photos();
    assert!(!photos.is_empty(), "no test photos: run `make models`");
    let limits = GpuLimits::default();
    let mut reference = GpuStages::load(
        &spec,
        device.clone(),
        ModelSource::OnnxRuntime { intra_threads: 4 },
        limits,
        gpu_support::blocks(&device),
    )
    .expect("the ONNX Runtime pipeline");
    let want: Vec<Vec<u8>> = photos
        .iter()
        .map(|(_, image)| {
            let out = reference
                .run(
                    &gpu_support::pixels(image),
                    Planes::ALPHA,
                    &mut StageTimings::default(),
                )
                .unwrap();
            out.alpha.expect("alpha asked for").into_raw().into_vec()
        })
        .collect();

    let precisions: &[Precision] = if trt.version().major >= 11 {
        &[Precision::FromModel]
    } else {
        &[Precision::Fp32, Precision::Fp16]
    };
    let engines = tempfile::tempdir().unwrap();
    let store = EngineStore::new(model_dir, Some(engines.path().to_path_buf()));
    let models = ModelFile::of_pipeline(&spec).unwrap();
    let gpu = device.info.identity();
    let runtime = trt.runtime(TrtContext::scope(device.context())).unwrap();
    for &precision in precisions {
        let options = BuildOptions {
            precision,
            workspace_mib: None,
            request: Default::default(),
        };
        let mut built = Vec::new();
        for model in &models {
            let stored = build_and_store(&trt, &store, model, &gpu, None, &options, &|_| {})
                .unwrap_or_else(|e| panic!("building {}: {e}", model.path.display()));
            let plan = std::fs::read(&stored.engine.plan).unwrap();
            built.push((model.key, runtime.deserialize(&plan).unwrap()));
        }
        let engine = |key: &str| built.iter().find(|(k, _)| *k == key).map(|(_, e)| e);
        let mut served = GpuStages::load(
            &spec,
            device.clone(),
            ModelSource::TensorRt {
                segmentation: engine(SEGMENTATION_MODEL).expect("a segmentation engine"),
                matting: engine(MATTING_MODEL),
            },
            limits,
            gpu_support::blocks(&device),
        )
        .expect("the pipeline on engines");
        assert_eq!(served.model_backend(), "TensorRT");
        let (max_mean, min_iou) = match precision {
            Precision::Fp16 | Precision::Bf16 => (2.0, 0.99),
            Precision::Fp32 | Precision::FromModel => (0.5, 0.999),
        };
        for ((name, image), want) in photos.iter().zip(&want) {
            let mut timings = StageTimings::default();
            let got = served
                .run(&gpu_support::pixels(image), Planes::ALL, &mut timings)
                .unwrap();
            let alpha = got.alpha.as_ref().expect("alpha asked for");
            let (mean, iou) = agreement(alpha.as_raw(), want);
            let _ = writeln!(
                std::io::stderr(),
                "{} {precision} {name}: mean |alpha diff| {mean:.3}/255, IoU {iou:.5}, model {:.2} ms",
                spec.source.display(),
                timings.model.as_secs_f64() * 1e3
            );
            assert!(
                mean <= max_mean,
                "{name} {precision}: mean difference {mean:.3}/255"
            );
            assert!(iou >= min_iou, "{name} {precision}: IoU {iou:.5}");
        }
    }
}

/// Each model of the pipeline in `model_dir` built now into an engine (at the precision
/// TensorRT builds by default: fp32 on 10, the model's own on 11) on GPU 0, by its key, and
/// the folder holding them.
pub fn engines_of(model_dir: &Path) -> (Vec<(&'static str, Arc<Engine>)>, tempfile::TempDir) {
    let spec = PipelineSpec::load_dir(model_dir)
        .unwrap_or_else(|e| panic!("{}: the pipeline description: {e}", model_dir.display()));
    let (device, trt) = gpu_and_tensorrt();
    device.context().bind_to_thread().unwrap();
    let engines = tempfile::tempdir().unwrap();
    let store = EngineStore::new(model_dir, Some(engines.path().to_path_buf()));
    let runtime = trt.runtime(TrtContext::scope(device.context())).unwrap();
    let options = BuildOptions {
        precision: if trt.version().major >= 11 {
            Precision::FromModel
        } else {
            Precision::Fp32
        },
        workspace_mib: None,
        request: Default::default(),
    };
    let gpu = device.info.identity();
    let built = ModelFile::of_pipeline(&spec)
        .unwrap()
        .iter()
        .map(|model| {
            let stored = build_and_store(&trt, &store, model, &gpu, None, &options, &|_| {})
                .unwrap_or_else(|e| panic!("building {}: {e}", model.path.display()));
            let plan = std::fs::read(&stored.engine.plan).unwrap();
            (model.key, runtime.deserialize(&plan).unwrap())
        })
        .collect();
    (built, engines)
}

/// The pipeline in `model_dir` served by `GpuStages` from engines built now (at the
/// precision TensorRT builds by default: fp32 on 10, the model's own on 11), within
/// `limits`. The folder holding the engines goes with the stages' last use.
pub fn stages_on_engines(
    model_dir: &Path,
    limits: GpuLimits,
    pool: &celer::cuda::HostPool,
) -> (GpuStages, tempfile::TempDir) {
    let (stages, engines) = try_stages_on_engines(model_dir, limits, pool);
    let stages = stages.expect("the pipeline on engines");
    assert_eq!(stages.model_backend(), "TensorRT");
    (stages, engines)
}

/// As `stages_on_engines`, with `GpuStages::load`'s answer as it is (the engines are built
/// and deserialised; the test fails if they cannot be).
pub fn try_stages_on_engines(
    model_dir: &Path,
    limits: GpuLimits,
    pool: &celer::cuda::HostPool,
) -> (Result<GpuStages, GpuError>, tempfile::TempDir) {
    let spec = PipelineSpec::load_dir(model_dir)
        .unwrap_or_else(|e| panic!("{}: the pipeline description: {e}", model_dir.display()));
    let (built, engines) = engines_of(model_dir);
    let device = gpu_support::gpu();
    let engine = |key: &str| built.iter().find(|(k, _)| *k == key).map(|(_, e)| e);
    pool.attach(device.context());
    let blocks: celer::pixels::SharedAlloc = Arc::new(pool.clone());
    let stages = GpuStages::load(
        &spec,
        device,
        ModelSource::TensorRt {
            segmentation: engine(SEGMENTATION_MODEL).expect("a segmentation engine"),
            matting: engine(MATTING_MODEL),
        },
        limits,
        blocks,
    );
    (stages, engines)
}

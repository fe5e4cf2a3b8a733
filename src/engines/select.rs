//! Serving from engines: which engine each model of the pipeline runs from on one GPU.
//! A stored plan whose manifest fits (the GPU model, the TensorRT version, the ONNX
//! file's bytes); one built at start-up, only when the operator asked for that; or none
//! at all when TensorRT is absent, where ONNX Runtime runs the models. Decided before the
//! server listens, so a plan that does not fit stops the start with the `celer build`
//! command that fixes it.

use std::path::Path;

use super::manifest::GpuIdentity;
use super::manifest::{find_engine_in, CheckedEngine, EngineCheckError, EngineRequirements};
use crate::tensorrt::{TrtError, TrtVersion};

/// One ONNX model of the pipeline, as the choice needs it.
#[derive(Debug, Clone, Copy)]
pub struct ModelRef<'a> {
    /// `segmentation` or `matting`.
    pub key: &'a str,
    pub onnx: &'a Path,
    /// The ONNX file's sha256 now.
    pub sha256: &'a str,
}

/// Where one model's engine comes from.
#[derive(Debug, Clone, PartialEq)]
pub enum EngineChoice {
    /// A stored plan that passed its manifest check and its sha256.
    Stored(Box<CheckedEngine>),
    /// None fits; built at start-up (`--build-engines`) for `reason`.
    Build { reason: String },
}

/// What one GPU's replicas run their models with.
#[derive(Debug, Clone, PartialEq)]
pub enum GpuModels {
    /// TensorRT cannot be used in this process (`reason`): ONNX Runtime on the CPU, with
    /// the pre- and post-processing still on the GPU.
    OnnxRuntime { reason: String },
    /// One engine per model, in the order given.
    TensorRt {
        version: TrtVersion,
        engines: Vec<(String, EngineChoice)>,
    },
}

impl GpuModels {
    /// Whether some engine is built before this GPU is ready.
    pub fn builds(&self) -> bool {
        matches!(self, Self::TensorRt { engines, .. }
            if engines.iter().any(|(_, c)| matches!(c, EngineChoice::Build { .. })))
    }
}

/// Chooses, for the GPU `gpu`, where each of `models` (of the pipeline in `model_dir`)
/// runs from, looking in the engine folders `engine_dirs` in order. `tensorrt` is the version
/// of the TensorRT library this process loaded, or why it could not load one. With
/// `build_missing`, a missing or unfit plan is built at start-up; without it, every unfit
/// plan is an error (the first folder's reason), each naming `celer build`.
pub fn choose_engines(
    tensorrt: Result<TrtVersion, &TrtError>,
    gpu: &GpuIdentity,
    model_dir: &Path,
    engine_dirs: &[&Path],
    models: &[ModelRef<'_>],
    build_missing: bool,
) -> Result<GpuModels, Vec<EngineCheckError>> {
    let version = match tensorrt {
        Ok(version) => version,
        Err(e) => {
            return Ok(GpuModels::OnnxRuntime {
                reason: e.to_string(),
            })
        }
    };
    let have = |sha256: &str| EngineRequirements {
        gpu: gpu.clone(),
        tensorrt_version: version,
        onnx_sha256: sha256.to_string(),
    };
    let mut engines = Vec::with_capacity(models.len());
    let mut refused = Vec::new();
    let find = |model: &ModelRef<'_>| {
        let mut first_error = None;
        for dir in engine_dirs {
            match find_engine_in(model_dir, dir, model.onnx, &have(model.sha256)) {
                Ok(checked) => return Ok(checked),
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        Err(first_error.unwrap_or_else(|| EngineCheckError::Io {
            path: model_dir.to_path_buf(),
            reason: "no engine folder to look in".into(),
        }))
    };
    for model in models {
        match find(model) {
            Ok(checked) => engines.push((
                model.key.to_string(),
                EngineChoice::Stored(Box::new(checked)),
            )),
            Err(e) if build_missing => engines.push((
                model.key.to_string(),
                EngineChoice::Build {
                    reason: e.to_string(),
                },
            )),
            Err(e) => refused.push(e),
        }
    }
    if refused.is_empty() {
        Ok(GpuModels::TensorRt { version, engines })
    } else {
        Err(refused)
    }
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;
    use crate::engines::manifest::{
        engine_dir, sha256_bytes, BuildRecord, EngineManifest, ENGINES_DIR, MANIFEST_FILE,
        MANIFEST_FORMAT,
    };
    use crate::tensorrt::Precision;

    const H200: (&str, &str) = ("NVIDIA H200", "9.0");
    const TRT: TrtVersion = TrtVersion {
        major: 10,
        minor: 16,
        patch: 0,
    };

    fn gpu((name, cc): (&str, &str)) -> GpuIdentity {
        GpuIdentity {
            name: name.into(),
            compute_capability: cc.into(),
        }
    }

    /// A model directory with `seg.onnx` (and its plan for `built_for` with `built_with`
    /// when given), as `celer build` would leave it.
    struct ModelDir {
        dir: tempfile::TempDir,
        onnx: PathBuf,
        sha256: String,
    }

    impl ModelDir {
        fn new() -> Self {
            let dir = tempfile::tempdir().unwrap();
            let onnx = dir.path().join("seg.onnx");
            let bytes = b"not really onnx, but bytes with a hash".to_vec();
            std::fs::write(&onnx, &bytes).unwrap();
            Self {
                sha256: sha256_bytes(&bytes),
                onnx,
                dir,
            }
        }

        fn store_plan(&self, built_for: &GpuIdentity, built_with: TrtVersion, onnx_sha: &str) {
            let plan = b"serialized engine".to_vec();
            let engine = engine_dir(&self.dir.path().join(ENGINES_DIR), "seg", built_for);
            std::fs::create_dir_all(&engine).unwrap();
            std::fs::write(engine.join("seg.plan"), &plan).unwrap();
            EngineManifest {
                format: MANIFEST_FORMAT,
                model: "seg".into(),
                onnx_file: "seg.onnx".into(),
                onnx_sha256: onnx_sha.into(),
                plan_file: "seg.plan".into(),
                plan_sha256: sha256_bytes(&plan),
                plan_bytes: plan.len() as u64,
                tensorrt_version: built_with,
                cuda_driver_version: Some("13.0".into()),
                gpu: built_for.clone(),
                precision: Precision::Fp16,
                profile: Vec::new(),
                inputs: Vec::new(),
                outputs: Vec::new(),
                build: BuildRecord {
                    celer_version: "test".into(),
                    built_at_unix_s: 0,
                    build_seconds: 1.0,
                    workspace_mib: None,
                    timing_cache: None,
                    tensorrt_library: "libnvinfer.so.10".into(),
                },
            }
            .write(&engine.join(MANIFEST_FILE))
            .unwrap();
        }

        fn models(&self) -> Vec<ModelRef<'_>> {
            vec![ModelRef {
                key: "segmentation",
                onnx: &self.onnx,
                sha256: &self.sha256,
            }]
        }

        fn choose(&self, build: bool) -> Result<GpuModels, Vec<EngineCheckError>> {
            let engines = self.dir.path().join(ENGINES_DIR);
            choose_engines(
                Ok(TRT),
                &gpu(H200),
                self.dir.path(),
                &[&engines],
                &self.models(),
                build,
            )
        }
    }

    #[test]
    fn without_tensorrt_the_models_run_on_onnx_runtime_and_say_why() {
        let dir = ModelDir::new();
        let absent = TrtError::LibraryNotFound("libnvinfer.so.10: no such file".into());
        let chosen = choose_engines(
            Err(&absent),
            &gpu(H200),
            dir.dir.path(),
            &[&dir.dir.path().join(ENGINES_DIR)],
            &dir.models(),
            false,
        )
        .unwrap();
        match chosen {
            GpuModels::OnnxRuntime { reason } => assert!(reason.contains("libnvinfer"), "{reason}"),
            other => panic!("expected ONNX Runtime, got {other:?}"),
        }
    }

    #[test]
    fn a_fitting_plan_is_served() {
        let dir = ModelDir::new();
        dir.store_plan(&gpu(H200), TRT, &dir.sha256);
        let chosen = dir.choose(false).unwrap();
        let GpuModels::TensorRt { version, engines } = &chosen else {
            panic!("expected TensorRT, got {chosen:?}");
        };
        assert_eq!(*version, TRT);
        assert!(!chosen.builds());
        match &engines[..] {
            [(key, EngineChoice::Stored(checked))] => {
                assert_eq!(key, "segmentation");
                assert!(checked.plan.ends_with("nvidia-h200-sm90/seg.plan"));
                assert_eq!(checked.manifest.precision, Precision::Fp16);
            }
            other => panic!("expected one stored engine, got {other:?}"),
        }
    }

    #[test]
    fn a_missing_plan_is_refused_with_the_build_command() {
        let dir = ModelDir::new();
        let errors = dir.choose(false).unwrap_err();
        assert_eq!(errors.len(), 1);
        let msg = errors[0].to_string();
        assert!(msg.contains("no engine for seg on NVIDIA H200"), "{msg}");
        assert!(
            msg.contains(&format!(
                "celer build --model-dir {}",
                dir.dir.path().display()
            )),
            "{msg}"
        );
    }

    #[test]
    fn plans_for_another_gpu_version_or_model_are_refused_naming_each_reason() {
        let dir = ModelDir::new();
        // Stored under the H200's folder, but recorded as built elsewhere, with another
        // TensorRT, from another ONNX file: all three reasons are said.
        let a100 = gpu(("NVIDIA A100-SXM4-80GB", "8.0"));
        dir.store_plan(&gpu(H200), TRT, &"0".repeat(64));
        let engine = engine_dir(&dir.dir.path().join(ENGINES_DIR), "seg", &gpu(H200));
        let path = engine.join(MANIFEST_FILE);
        let mut manifest = EngineManifest::read(&path).unwrap();
        manifest.gpu = a100;
        manifest.tensorrt_version = "10.3.0".parse().unwrap();
        manifest.write(&path).unwrap();

        let errors = dir.choose(false).unwrap_err();
        let msg = errors[0].to_string();
        assert!(msg.contains("does not fit this machine"), "{msg}");
        assert!(msg.contains("built for NVIDIA A100-SXM4-80GB"), "{msg}");
        assert!(
            msg.contains("built with TensorRT 10.3.0, this is TensorRT 10.16.0"),
            "{msg}"
        );
        assert!(msg.contains("built from another seg.onnx"), "{msg}");
        assert!(
            msg.contains("rebuild it with `celer build --model-dir"),
            "{msg}"
        );
    }

    #[test]
    fn with_build_missing_an_unfit_or_missing_plan_is_built_at_start_up() {
        let dir = ModelDir::new();
        let chosen = dir.choose(true).unwrap();
        assert!(chosen.builds());
        let GpuModels::TensorRt { engines, .. } = chosen else {
            panic!("expected TensorRT");
        };
        match &engines[..] {
            [(_, EngineChoice::Build { reason })] => {
                assert!(reason.contains("no engine for seg"), "{reason}")
            }
            other => panic!("expected one engine to build, got {other:?}"),
        }

        // A stale plan (another TensorRT) is rebuilt too, and the reason says why.
        dir.store_plan(&gpu(H200), "10.3.0".parse().unwrap(), &dir.sha256);
        let GpuModels::TensorRt { engines, .. } = dir.choose(true).unwrap() else {
            panic!("expected TensorRT");
        };
        match &engines[..] {
            [(_, EngineChoice::Build { reason })] => {
                assert!(reason.contains("built with TensorRT 10.3.0"), "{reason}")
            }
            other => panic!("expected one engine to rebuild, got {other:?}"),
        }
    }
}

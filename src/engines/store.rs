//! The engine store: builds one model's TensorRT engine for one GPU model and stores it
//! (plan, manifest, the GPU's timing cache) where `find_engine` looks, for `celer build`
//! and for `serve` building missing engines at start-up. It prints nothing (callers hear
//! [`BuildEvent`]s) and never chooses or binds the GPU: that is the caller's.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use crate::spec::PipelineSpec;

use super::manifest::{
    engine_dir, find_engine_in, model_name, sha256_bytes, sha256_file, write_atomically,
    BuildRecord, CheckedEngine, EngineCheckError, EngineManifest, EngineRequirements, GpuIdentity,
    ENGINES_DIR, MANIFEST_FILE, MANIFEST_FORMAT,
};
use super::profile::{resolve_profile, shape_hints, ProfileError, ShapeHint, ShapeRequest};
use crate::tensorrt::TensorRt;
use crate::tensorrt::{
    BuildProgress, BuildSettings, BuiltEngine, InputProfile, Precision, TensorDesc, TrtError,
    TrtVersion,
};

/// The folder, inside the engines folder, of the timing caches.
const TIMING_CACHE_DIR: &str = "timing-cache";

/// One ONNX model of the pipeline, as the engine store sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ModelFile {
    /// The pipeline key naming it, e.g. `segmentation.model`.
    pub key: &'static str,
    pub path: PathBuf,
    /// Its file's stem: the engine folder's name.
    pub name: String,
    /// sha256 of the file, lowercase hex; the manifest records it.
    pub sha256: String,
    /// The shapes the pipeline feeds its inputs.
    pub hints: Vec<ShapeHint>,
}

impl ModelFile {
    /// Every model of `spec` (`spec.model_keys()`), hashed.
    pub fn of_pipeline(spec: &PipelineSpec) -> Result<Vec<ModelFile>, StoreError> {
        spec.model_keys()
            .into_iter()
            .map(|(key, path)| {
                let sha256 = sha256_file(path).map_err(|error| StoreError::Read {
                    path: path.to_path_buf(),
                    error,
                })?;
                Ok(ModelFile {
                    key,
                    path: path.to_path_buf(),
                    name: model_name(path),
                    sha256,
                    hints: shape_hints(spec, path),
                })
            })
            .collect()
    }
}

/// Where engines go: `<model_dir>/engines` unless overridden.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineStore {
    /// The model directory; manifests name ONNX files relative to it.
    pub model_dir: PathBuf,
    pub engines: PathBuf,
}

impl EngineStore {
    pub fn new(model_dir: &Path, engines: Option<PathBuf>) -> Self {
        Self {
            model_dir: model_dir.to_path_buf(),
            engines: engines.unwrap_or_else(|| model_dir.join(ENGINES_DIR)),
        }
    }

    /// The timing cache for `gpu` and TensorRT `version`. One per pair: the builder
    /// refuses (and replaces) a cache from another GPU model or TensorRT version.
    pub fn timing_cache_path(&self, gpu: &GpuIdentity, version: TrtVersion) -> PathBuf {
        self.engines
            .join(TIMING_CACHE_DIR)
            .join(format!("{}-trt{version}.cache", gpu.key()))
    }

    /// The folder of `model`'s engine for `gpu` (its plan and manifest.json).
    pub fn engine_dir(&self, model: &ModelFile, gpu: &GpuIdentity) -> PathBuf {
        engine_dir(&self.engines, &model.name, gpu)
    }

    /// `model`'s engine for `gpu` and TensorRT `version`, checked as [`find_engine`]
    /// checks it, in this store's engines folder.
    ///
    /// [`find_engine`]: super::manifest::find_engine
    pub fn find(
        &self,
        model: &ModelFile,
        gpu: &GpuIdentity,
        version: TrtVersion,
    ) -> Result<CheckedEngine, EngineCheckError> {
        let have = EngineRequirements {
            gpu: gpu.clone(),
            tensorrt_version: version,
            onnx_sha256: model.sha256.clone(),
        };
        find_engine_in(&self.model_dir, &self.engines, &model.path, &have)
    }
}

/// How to build: the same for every model and GPU of one run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BuildOptions {
    /// From [`choose_precision`]; `build_and_store` refuses one the TensorRT major cannot
    /// build.
    pub precision: Precision,
    /// Builder workspace limit; `None` leaves TensorRT's default (the device's memory).
    pub workspace_mib: Option<u64>,
    /// Batch and shape ranges for the optimisation profile.
    pub request: ShapeRequest,
}

/// What a build reports while it runs, for the CLI's printing or the server's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BuildEvent<'a> {
    /// An input or output of the parsed network, inputs first.
    Tensor(&'a TensorDesc),
    /// The optimisation profile, just before the build starts (empty: static shapes).
    Profile(&'a [InputProfile]),
    /// TensorRT's build phases, possibly from TensorRT's own threads.
    Progress(BuildProgress<'a>),
    /// The build starts from this timing cache (reported before parsing).
    TimingCacheReused(&'a Path),
}

/// An engine just built and stored.
#[derive(Debug, Clone, PartialEq)]
pub struct StoredEngine {
    /// As `find_engine` returns it.
    pub engine: CheckedEngine,
    /// Parsing and building, without reading or writing files.
    pub build_time: Duration,
}

/// Why an engine could not be built or stored. Each message is whole (the cause is in
/// it), so a log line or `anyhow`'s chain says it once.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot read {}: {error}", path.display())]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("cannot write {}: {error}", path.display())]
    Write {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error(
        "--precision {requested}: TensorRT {major} builds strongly typed networks, so the \
         precision comes from the ONNX model's types and cannot be chosen at build time. \
         Export the model in the precision you want (e.g. float16 with onnxconverter-common) \
         and build without --precision"
    )]
    PrecisionFromModel { requested: Precision, major: u32 },
    #[error("TensorRT {major} needs a precision: fp32, fp16 or bf16")]
    PrecisionNeeded { major: u32 },
    #[error("building {} for {gpu}: optimisation profile: {error}", model.display())]
    Profile {
        model: PathBuf,
        gpu: String,
        error: ProfileError,
    },
    #[error("building {} for {gpu}: {error}", model.display())]
    Build {
        model: PathBuf,
        gpu: String,
        error: TrtError,
    },
}

/// The precision for TensorRT `major` given the request, and a phrase saying why (for a
/// `precision: ...` line). TensorRT 10 takes the precision as builder flags (fp32 by
/// default); 11 builds strongly typed networks and has no such flags, so a requested
/// precision there is an error, not a silent no-op.
pub fn choose_precision(
    major: u32,
    requested: Option<Precision>,
) -> Result<(Precision, String), StoreError> {
    match (major >= 11, requested) {
        (true, None) => Ok((
            Precision::FromModel,
            format!(
                "from the model (TensorRT {major} builds strongly typed networks: each layer \
                 runs in the type the ONNX model gives it)"
            ),
        )),
        (true, Some(requested)) => Err(StoreError::PrecisionFromModel { requested, major }),
        (false, None) => Ok((
            Precision::Fp32,
            "fp32 (default; --precision fp16 is usually much faster)".into(),
        )),
        (false, Some(Precision::FromModel)) => Err(StoreError::PrecisionNeeded { major }),
        (false, Some(p)) => Ok((p, p.to_string())),
    }
}

/// Whether TensorRT `major` can build `precision`: what [`choose_precision`] could have
/// chosen for it.
fn check_precision(major: u32, precision: Precision) -> Result<(), StoreError> {
    if major >= 11 && precision == Precision::FromModel {
        return Ok(());
    }
    choose_precision(major, Some(precision)).map(|_| ())
}

/// Parses and builds `model` for `gpu` with `trt` (the GPU must be current on this
/// thread), reads and updates the timing cache, writes
/// `<engines>/<model>/<gpu key>/<model>.plan` + manifest.json atomically, and returns the
/// stored engine (as `find_engine` would return it) and the build time.
pub fn build_and_store(
    trt: &TensorRt,
    store: &EngineStore,
    model: &ModelFile,
    gpu: &GpuIdentity,
    driver_cuda_version: Option<String>,
    options: &BuildOptions,
    events: &(dyn Fn(BuildEvent<'_>) + Sync),
) -> Result<StoredEngine, StoreError> {
    let version = trt.version();
    check_precision(version.major, options.precision)?;
    let cache_path = store.timing_cache_path(gpu, version);
    // No cache (or an unreadable one) only costs build time: the builder starts anew.
    let cache = std::fs::read(&cache_path).ok();
    if cache.is_some() {
        events(BuildEvent::TimingCacheReused(&cache_path));
    }
    let started = Instant::now();
    let (io, profile, built) = build_model(trt, model, gpu, options, cache, events)?;
    let build = FinishedBuild {
        io,
        profile,
        built,
        build_time: started.elapsed(),
        tensorrt_version: version,
        tensorrt_library: trt.library_file(),
        driver_cuda_version,
    };
    store_built(store, model, gpu, options, build)
}

/// Parses and builds one model; the network (and its builder's memory) is freed on
/// return, before the next model is parsed.
fn build_model(
    trt: &TensorRt,
    model: &ModelFile,
    gpu: &GpuIdentity,
    options: &BuildOptions,
    timing_cache: Option<Vec<u8>>,
    events: &(dyn Fn(BuildEvent<'_>) + Sync),
) -> Result<(Vec<TensorDesc>, Vec<InputProfile>, BuiltEngine), StoreError> {
    let failed = |error: TrtError| StoreError::Build {
        model: model.path.clone(),
        gpu: gpu.name.clone(),
        error,
    };
    let mut network = trt.parse_onnx(&model.path).map_err(failed)?;
    let mut io = network.inputs().map_err(failed)?;
    io.extend(network.outputs().map_err(failed)?);
    for t in &io {
        events(BuildEvent::Tensor(t));
    }
    let shapes: Vec<(&str, &[i64])> = io
        .iter()
        .filter(|t| t.is_input)
        .map(|t| (t.name.as_str(), t.shape.as_slice()))
        .collect();
    let profile = resolve_profile(&shapes, &model.hints, &options.request).map_err(|error| {
        StoreError::Profile {
            model: model.path.clone(),
            gpu: gpu.name.clone(),
            error,
        }
    })?;
    events(BuildEvent::Profile(&profile));
    let settings = BuildSettings {
        precision: options.precision,
        workspace_bytes: options.workspace_mib.map(|mib| mib.saturating_mul(1 << 20)),
        profile: profile.clone(),
        timing_cache,
    };
    let built = network
        .build(&settings, &|p| events(BuildEvent::Progress(p)))
        .map_err(failed)?;
    Ok((io, profile, built))
}

/// What one build produced, and what the manifest records of the TensorRT that did it.
struct FinishedBuild<'a> {
    /// The network's inputs and outputs, in any order.
    io: Vec<TensorDesc>,
    profile: Vec<InputProfile>,
    built: BuiltEngine,
    build_time: Duration,
    tensorrt_version: TrtVersion,
    tensorrt_library: &'a Path,
    driver_cuda_version: Option<String>,
}

/// Writes the plan, then the updated timing cache, then the manifest: a manifest only
/// ever names a plan that is already in place.
fn store_built(
    store: &EngineStore,
    model: &ModelFile,
    gpu: &GpuIdentity,
    options: &BuildOptions,
    build: FinishedBuild<'_>,
) -> Result<StoredEngine, StoreError> {
    let write = |path: &Path, bytes: &[u8]| {
        write_atomically(path, bytes).map_err(|error| StoreError::Write {
            path: path.to_path_buf(),
            error,
        })
    };
    let dir = store.engine_dir(model, gpu);
    let plan_file = format!("{}.plan", model.name);
    let plan = dir.join(&plan_file);
    write(&plan, &build.built.plan)?;
    let cache_path = store.timing_cache_path(gpu, build.tensorrt_version);
    if let Some(bytes) = &build.built.timing_cache {
        write(&cache_path, bytes)?;
    }
    let (inputs, outputs): (Vec<_>, Vec<_>) = build.io.into_iter().partition(|t| t.is_input);
    let manifest = EngineManifest {
        format: MANIFEST_FORMAT,
        model: model.name.clone(),
        onnx_file: model
            .path
            .strip_prefix(&store.model_dir)
            .unwrap_or(&model.path)
            .display()
            .to_string(),
        onnx_sha256: model.sha256.clone(),
        plan_file,
        plan_sha256: sha256_bytes(&build.built.plan),
        plan_bytes: build.built.plan.len() as u64,
        tensorrt_version: build.tensorrt_version,
        cuda_driver_version: build.driver_cuda_version,
        gpu: gpu.clone(),
        precision: options.precision,
        profile: build.profile,
        inputs,
        outputs,
        build: BuildRecord {
            celer_version: env!("CARGO_PKG_VERSION").into(),
            built_at_unix_s: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            build_seconds: build.build_time.as_secs_f64(),
            workspace_mib: options.workspace_mib,
            timing_cache: Some(
                cache_path
                    .strip_prefix(&store.engines)
                    .unwrap_or(&cache_path)
                    .display()
                    .to_string(),
            ),
            tensorrt_library: build.tensorrt_library.display().to_string(),
        },
    };
    let manifest_path = dir.join(MANIFEST_FILE);
    manifest
        .write(&manifest_path)
        .map_err(|error| StoreError::Write {
            path: manifest_path,
            error,
        })?;
    Ok(StoredEngine {
        engine: CheckedEngine { plan, manifest },
        build_time: build.build_time,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::manifest::find_engine;
    use crate::tensorrt::DataType;

    fn repo(path: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
    }

    fn models_of(dir: &Path) -> Vec<ModelFile> {
        let spec = PipelineSpec::load_dir(dir).unwrap();
        ModelFile::of_pipeline(&spec).unwrap()
    }

    fn h200() -> GpuIdentity {
        GpuIdentity {
            name: "NVIDIA H200".into(),
            compute_capability: "9.0".into(),
        }
    }

    fn trt(version: &str) -> TrtVersion {
        version.parse().unwrap()
    }

    fn hint(name: &str, nchw: [i64; 4]) -> ShapeHint {
        ShapeHint {
            name: name.into(),
            nchw,
        }
    }

    #[test]
    fn two_model_pipeline_lists_both_models_hashed() {
        let models = models_of(&repo("onnx/fixtures/classes-matting"));
        let keys: Vec<_> = models.iter().map(|m| (m.key, m.name.as_str())).collect();
        assert_eq!(
            keys,
            [("segmentation.model", "seg3"), ("matting.model", "matting")]
        );
        for m in &models {
            assert!(m.path.is_file(), "{}", m.path.display());
            assert_eq!(m.sha256, sha256_file(&m.path).unwrap());
            assert_eq!(m.sha256.len(), 64);
        }
        assert_ne!(models[0].sha256, models[1].sha256);
        assert_eq!(models[0].hints, [hint("image", [1, 3, 64, 64])]);
        assert_eq!(
            models[1].hints,
            [
                hint("image", [1, 3, 64, 64]),
                hint("trimap", [1, 1, 64, 64])
            ]
        );
    }

    #[test]
    fn guided_filter_pipeline_has_one_model() {
        let models = models_of(&repo("onnx/fixtures/prob-guided"));
        assert_eq!(models.len(), 1);
        assert_eq!(
            (models[0].key, models[0].name.as_str()),
            ("segmentation.model", "prob")
        );
        assert!(models[0].path.ends_with("prob.onnx"));
        assert_eq!(models[0].sha256, sha256_file(&models[0].path).unwrap());
        assert_eq!(models[0].hints, [hint("image", [1, 3, 64, 64])]);
    }

    #[test]
    fn u2netp_pipeline_model_is_hashed() {
        let dir = repo("onnx/u2netp");
        assert!(
            dir.join("u2netp.onnx").is_file(),
            "onnx/u2netp/u2netp.onnx is missing: run `make models`"
        );
        let models = models_of(&dir);
        assert_eq!(models.len(), 1);
        assert_eq!(
            (models[0].key, models[0].name.as_str()),
            ("segmentation.model", "u2netp")
        );
        assert_eq!(
            models[0].sha256,
            sha256_file(&dir.join("u2netp.onnx")).unwrap()
        );
        assert_eq!(models[0].hints, [hint("input.1", [1, 3, 320, 320])]);
    }

    #[test]
    fn missing_model_file_is_a_read_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let toml = std::fs::read_to_string(repo("onnx/fixtures/prob-guided/celer.toml"))
            .unwrap()
            .replace("../prob.onnx", "absent.onnx");
        std::fs::write(dir.path().join("celer.toml"), toml).unwrap();
        let spec = PipelineSpec::load_dir(dir.path()).unwrap();
        let err = ModelFile::of_pipeline(&spec).unwrap_err();
        assert!(matches!(err, StoreError::Read { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.starts_with("cannot read "), "{msg}");
        assert!(msg.contains("absent.onnx"), "{msg}");
    }

    #[test]
    fn store_paths_default_to_the_model_dir() {
        let store = EngineStore::new(Path::new("/opt/ml/model"), None);
        assert_eq!(store.model_dir, Path::new("/opt/ml/model"));
        assert_eq!(store.engines, Path::new("/opt/ml/model/engines"));
        assert_eq!(
            store.timing_cache_path(&h200(), trt("10.16.0")),
            Path::new("/opt/ml/model/engines/timing-cache/nvidia-h200-sm90-trt10.16.0.cache")
        );
        let u2netp = ModelFile {
            key: "segmentation.model",
            path: "/opt/ml/model/u2netp.onnx".into(),
            name: "u2netp".into(),
            sha256: "ab".into(),
            hints: vec![],
        };
        assert_eq!(
            store.engine_dir(&u2netp, &h200()),
            Path::new("/opt/ml/model/engines/u2netp/nvidia-h200-sm90")
        );

        let elsewhere = EngineStore::new(Path::new("/opt/ml/model"), Some("/scratch/e".into()));
        assert_eq!(elsewhere.model_dir, Path::new("/opt/ml/model"));
        assert_eq!(
            elsewhere.timing_cache_path(&h200(), trt("11.1.2")),
            Path::new("/scratch/e/timing-cache/nvidia-h200-sm90-trt11.1.2.cache")
        );
        assert_ne!(
            elsewhere.timing_cache_path(&h200(), trt("11.1.2")),
            elsewhere.timing_cache_path(&h200(), trt("11.1.3")),
            "a cache per TensorRT version"
        );
    }

    #[test]
    fn precision_follows_the_tensorrt_major() {
        let chosen = |major, requested| choose_precision(major, requested).unwrap();
        let (p, why) = chosen(10, None);
        assert_eq!(p, Precision::Fp32);
        assert!(why.contains("default"), "{why}");
        assert_eq!(chosen(10, Some(Precision::Fp16)).0, Precision::Fp16);
        assert_eq!(chosen(10, Some(Precision::Bf16)).0, Precision::Bf16);
        let (p, why) = chosen(11, None);
        assert_eq!(p, Precision::FromModel);
        assert!(why.contains("strongly typed"), "{why}");

        let msg = choose_precision(11, Some(Precision::Fp16))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("strongly typed"), "{msg}");
        assert!(msg.contains("--precision fp16"), "{msg}");
        let err = choose_precision(10, Some(Precision::FromModel)).unwrap_err();
        assert!(
            matches!(err, StoreError::PrecisionNeeded { major: 10 }),
            "{err}"
        );
    }

    #[test]
    fn a_build_refuses_a_precision_its_tensorrt_cannot_build() {
        assert!(check_precision(11, Precision::FromModel).is_ok());
        assert!(check_precision(10, Precision::Fp16).is_ok());
        assert!(matches!(
            check_precision(11, Precision::Fp32),
            Err(StoreError::PrecisionFromModel { major: 11, .. })
        ));
        assert!(matches!(
            check_precision(10, Precision::FromModel),
            Err(StoreError::PrecisionNeeded { major: 10 })
        ));
    }

    /// A model directory with prob.onnx and a celer.toml naming it, and its one model.
    fn model_dir() -> (tempfile::TempDir, ModelFile) {
        let dir = tempfile::tempdir().unwrap();
        std::fs::copy(
            repo("onnx/fixtures/prob.onnx"),
            dir.path().join("prob.onnx"),
        )
        .unwrap();
        let toml = std::fs::read_to_string(repo("onnx/fixtures/prob-guided/celer.toml"))
            .unwrap()
            .replace("../prob.onnx", "prob.onnx");
        std::fs::write(dir.path().join("celer.toml"), toml).unwrap();
        let mut models = models_of(dir.path());
        (dir, models.remove(0))
    }

    /// What a TensorRT build of prob.onnx would hand to `store_built`.
    fn built(plan: &[u8], timing_cache: Option<&[u8]>) -> FinishedBuild<'static> {
        let tensor = |name: &str, is_input, shape: Vec<i64>| TensorDesc {
            name: name.into(),
            is_input,
            data_type: DataType::Float,
            shape,
        };
        FinishedBuild {
            io: vec![
                tensor("image", true, vec![-1, 3, 64, 64]),
                tensor("mask", false, vec![-1, 1, 64, 64]),
            ],
            profile: vec![InputProfile {
                name: "image".into(),
                min: vec![1, 3, 64, 64],
                opt: vec![1, 3, 64, 64],
                max: vec![1, 3, 64, 64],
            }],
            built: BuiltEngine {
                plan: plan.to_vec(),
                timing_cache: timing_cache.map(<[u8]>::to_vec),
            },
            build_time: Duration::from_millis(1500),
            tensorrt_version: "10.16.0".parse().unwrap(),
            tensorrt_library: Path::new("/usr/lib/libnvinfer.so.10"),
            driver_cuda_version: Some("12.8".into()),
        }
    }

    fn fp16() -> BuildOptions {
        BuildOptions {
            precision: Precision::Fp16,
            workspace_mib: Some(512),
            request: ShapeRequest::default(),
        }
    }

    #[test]
    fn stored_engine_is_what_find_engine_returns() {
        let (dir, model) = model_dir();
        let store = EngineStore::new(dir.path(), None);
        let stored = store_built(
            &store,
            &model,
            &h200(),
            &fp16(),
            built(b"plan bytes", Some(b"cache")),
        )
        .unwrap();
        assert_eq!(stored.build_time, Duration::from_millis(1500));
        let have = EngineRequirements {
            gpu: h200(),
            tensorrt_version: trt("10.16.0"),
            onnx_sha256: model.sha256.clone(),
        };
        let found = find_engine(dir.path(), &model.path, &have).unwrap();
        assert_eq!(found, stored.engine);
        assert_eq!(store.find(&model, &h200(), trt("10.16.0")).unwrap(), found);

        let m = &found.manifest;
        assert_eq!(m.onnx_file, "prob.onnx", "relative to the model directory");
        assert_eq!(m.precision, Precision::Fp16);
        assert_eq!(m.plan_bytes, 10);
        assert_eq!(m.inputs.len(), 1);
        assert_eq!(m.outputs[0].name, "mask");
        assert_eq!(m.build.workspace_mib, Some(512));
        assert_eq!(
            m.build.timing_cache.as_deref(),
            Some("timing-cache/nvidia-h200-sm90-trt10.16.0.cache")
        );
        assert_eq!(
            std::fs::read(store.timing_cache_path(&h200(), trt("10.16.0"))).unwrap(),
            b"cache"
        );
        assert_eq!(std::fs::read(&found.plan).unwrap(), b"plan bytes");
    }

    #[test]
    fn engines_elsewhere_are_found_there() {
        let (dir, model) = model_dir();
        let engines = tempfile::tempdir().unwrap();
        let store = EngineStore::new(dir.path(), Some(engines.path().to_path_buf()));
        let stored = store_built(&store, &model, &h200(), &fp16(), built(b"plan", None)).unwrap();
        assert!(stored.engine.plan.starts_with(engines.path()));
        assert_eq!(
            store.find(&model, &h200(), trt("10.16.0")).unwrap(),
            stored.engine
        );
        assert!(
            !store.timing_cache_path(&h200(), trt("10.16.0")).exists(),
            "no cache from the builder, none written"
        );
        assert!(!dir.path().join(ENGINES_DIR).exists());
        // Another TensorRT needs its own build.
        let err = store.find(&model, &h200(), trt("10.16.1")).unwrap_err();
        assert!(matches!(err, EngineCheckError::Mismatch { .. }), "{err}");
    }

    #[test]
    fn rebuilding_replaces_the_plan_and_its_manifest() {
        let (dir, model) = model_dir();
        let store = EngineStore::new(dir.path(), None);
        store_built(&store, &model, &h200(), &fp16(), built(b"first", None)).unwrap();
        let second = store_built(
            &store,
            &model,
            &h200(),
            &fp16(),
            built(b"second plan", None),
        )
        .unwrap();
        let found = store.find(&model, &h200(), trt("10.16.0")).unwrap();
        assert_eq!(found, second.engine);
        assert_eq!(found.manifest.plan_sha256, sha256_bytes(b"second plan"));
        let leftovers: Vec<_> = std::fs::read_dir(store.engine_dir(&model, &h200()))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('.'))
            .collect();
        assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    }

    #[test]
    fn unwritable_engines_folder_is_a_write_error_naming_the_plan() {
        let (dir, model) = model_dir();
        // A file where the engines folder should be: nothing can be created under it.
        let blocker = dir.path().join("not-a-folder");
        std::fs::write(&blocker, b"").unwrap();
        let store = EngineStore::new(dir.path(), Some(blocker));
        let err = store_built(&store, &model, &h200(), &fp16(), built(b"p", None)).unwrap_err();
        assert!(matches!(err, StoreError::Write { .. }), "{err}");
        assert!(err.to_string().contains("prob.plan"), "{err}");
    }
}

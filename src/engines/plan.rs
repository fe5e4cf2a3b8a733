//! Which engines each GPU serves from, decided before the server listens (`plan_gpus`:
//! a stored plan that fits, one to build with `--build-engines`, or ONNX Runtime where
//! TensorRT is absent), and, once a GPU is open, its engines deserialised (or built
//! first, one build at a time in the process) for its replicas to share
//! (`GpuPlan::load_engines`).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use super::dirs::EngineDirs;
use super::manifest::{CheckedEngine, GpuIdentity};
use super::select::{choose_engines, EngineChoice, GpuModels, ModelRef};
use super::store::{
    build_and_store, choose_precision, BuildOptions, EngineStore, ModelFile, StoreError,
};
use crate::cuda::trt_context::TrtContext;
use crate::cuda::{GpuDevice, GpuInfo};
use crate::spec::{PipelineSpec, MATTING_MODEL, SEGMENTATION_MODEL};
use crate::tensorrt::{Engine, TensorRt, TrtError};

/// Why a GPU's engines could not be planned or loaded.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// Stored plans that do not fit, one line each with the command that fixes it.
    #[error("{}", .0.join("\n"))]
    Refused(Vec<String>),
    #[error(transparent)]
    Store(#[from] Box<StoreError>),
    #[error("{device}: TensorRT {version} was chosen but is not loaded")]
    TensorRtMissing { device: String, version: String },
    #[error("{device}: {source}")]
    TensorRt { device: String, source: TrtError },
    #[error("{device}: cannot read {}: {source}", .plan.display())]
    Read {
        device: String,
        plan: PathBuf,
        source: std::io::Error,
    },
    #[error("{device}: {}: {source}", .plan.display())]
    Deserialize {
        device: String,
        plan: PathBuf,
        source: TrtError,
    },
    #[error("{device}: building {}: {source}", .model.display())]
    Build {
        device: String,
        model: PathBuf,
        source: Box<StoreError>,
    },
    #[error("{device}: {reason}")]
    Pipeline { device: String, reason: String },
}

/// What one GPU's replicas start from, decided before the server listens.
pub struct GpuPlan {
    pub info: GpuInfo,
    pub models: GpuModels,
    shared: Arc<SharedEngines>,
}

/// What every GPU of the process shares: TensorRT (when loaded), the pipeline's model
/// files, where engines are stored and how missing ones are built.
struct SharedEngines {
    tensorrt: Option<TensorRt>,
    model_files: Vec<ModelFile>,
    store: EngineStore,
    /// `Some` with `--build-engines`.
    build: Option<BuildOptions>,
    /// Held while an engine builds: two GPUs of one model would otherwise build the same
    /// engine twice, and a build already uses the whole GPU.
    one_build: Mutex<()>,
    driver_cuda_version: Option<String>,
}

/// A GPU's engines, deserialised in its context: shared by its replicas, each of which
/// makes its own execution contexts.
pub struct GpuEngines {
    pub segmentation: Arc<Engine>,
    pub matting: Option<Arc<Engine>>,
}

/// Decides, for each of `gpus`, where the models of `spec` run from, with the engines in
/// `engines` (built ones written to `engines.built`). TensorRT is loaded once (with its
/// ONNX parser when `build_engines`); when it cannot be, every GPU runs the models with
/// ONNX Runtime, and the log says why, once. Every plan that does not fit is reported
/// together, each with the `celer build` command that fixes it.
pub fn plan_gpus(
    spec: &PipelineSpec,
    model_dir: &Path,
    engines: &EngineDirs,
    gpus: &[GpuInfo],
    build_engines: bool,
    driver_cuda_version: Option<String>,
) -> Result<Vec<GpuPlan>, PlanError> {
    let model_files = ModelFile::of_pipeline(spec).map_err(Box::new)?;
    let tensorrt = if build_engines {
        TensorRt::load_builder()
    } else {
        TensorRt::load_runtime()
    };
    let build = match (&tensorrt, build_engines) {
        (Ok(trt), true) => Some(BuildOptions {
            precision: choose_precision(trt.version().major, None)
                .map_err(Box::new)?
                .0,
            workspace_mib: None,
            request: Default::default(),
        }),
        _ => None,
    };
    match &tensorrt {
        Ok(trt) => tracing::info!(
            version = %trt.version(),
            library = %trt.library_file().display(),
            "TensorRT loaded: the GPUs serve from engines"
        ),
        Err(e) => tracing::warn!(
            reason = %e,
            "TensorRT is not available: the GPU replicas run the models with ONNX Runtime on \
             the CPU (pre- and post-processing stay on the GPU)"
        ),
    }
    let shared = Arc::new(SharedEngines {
        tensorrt: tensorrt.as_ref().ok().cloned(),
        model_files,
        store: EngineStore::new(model_dir, Some(engines.built.clone())),
        build,
        one_build: Mutex::new(()),
        driver_cuda_version,
    });
    let refs: Vec<ModelRef<'_>> = shared
        .model_files
        .iter()
        .map(|m| ModelRef {
            key: m.key,
            onnx: &m.path,
            sha256: &m.sha256,
        })
        .collect();
    let mut plans = Vec::with_capacity(gpus.len());
    let mut refused = Vec::new();
    for info in gpus {
        let version = tensorrt.as_ref().map(TensorRt::version);
        match choose_engines(
            version,
            &info.identity(),
            model_dir,
            &engines.search_order(),
            &refs,
            build_engines,
        ) {
            Ok(models) => plans.push(GpuPlan {
                info: info.clone(),
                models,
                shared: shared.clone(),
            }),
            Err(errors) => refused.extend(
                errors
                    .into_iter()
                    .map(|e| format!("GPU {}: {e}", info.ordinal)),
            ),
        }
    }
    if refused.is_empty() {
        Ok(plans)
    } else {
        refused
            .push("or serve without engines (ONNX Runtime on the CPU): --devices cpu".to_string());
        Err(PlanError::Refused(refused))
    }
}

impl GpuPlan {
    /// The GPU's engines, deserialised into `gpu`'s context (built first where the plan
    /// says so, with that context current on this thread), or `None` when its models run
    /// on ONNX Runtime. Engines live in the context they were deserialised in, and are
    /// destroyed with it current, wherever they are dropped.
    pub fn load_engines(
        &self,
        spec: &PipelineSpec,
        gpu: &GpuDevice,
        device: &str,
    ) -> Result<Option<GpuEngines>, PlanError> {
        let GpuModels::TensorRt { version, engines } = &self.models else {
            return Ok(None);
        };
        let trt = self
            .shared
            .tensorrt
            .as_ref()
            .ok_or_else(|| PlanError::TensorRtMissing {
                device: device.to_string(),
                version: version.to_string(),
            })?;
        let trt_error = |source| PlanError::TensorRt {
            device: device.to_string(),
            source,
        };
        let runtime = trt
            .runtime(TrtContext::scope(gpu.context()))
            .map_err(trt_error)?;
        let identity = self.info.identity();
        let (mut segmentation, mut matting) = (None, None);
        for (key, choice) in engines {
            let checked = match choice {
                EngineChoice::Stored(checked) => (**checked).clone(),
                EngineChoice::Build { reason } => {
                    self.build_engine(trt, key, &identity, reason, device)?
                }
            };
            let bytes = std::fs::read(&checked.plan).map_err(|source| PlanError::Read {
                device: device.to_string(),
                plan: checked.plan.clone(),
                source,
            })?;
            let engine = runtime
                .deserialize(&bytes)
                .map_err(|source| PlanError::Deserialize {
                    device: device.to_string(),
                    plan: checked.plan.clone(),
                    source,
                })?;
            tracing::info!(
                device,
                model = %key,
                plan = %checked.plan.display(),
                precision = %checked.manifest.precision,
                mib = format!("{:.1}", bytes.len() as f64 / f64::from(1 << 20)),
                "engine loaded"
            );
            match key.as_str() {
                SEGMENTATION_MODEL => segmentation = Some(engine),
                MATTING_MODEL => matting = Some(engine),
                other => {
                    return Err(PlanError::Pipeline {
                        device: device.to_string(),
                        reason: format!("unknown model `{other}` of the pipeline"),
                    })
                }
            }
        }
        let segmentation = segmentation.ok_or_else(|| PlanError::Pipeline {
            device: device.to_string(),
            reason: format!("no segmentation engine for {}", spec.source.display()),
        })?;
        Ok(Some(GpuEngines {
            segmentation,
            matting,
        }))
    }

    /// Builds the engine of model `key` for this GPU (`--build-engines`), unless another
    /// GPU of the same model built it meanwhile.
    fn build_engine(
        &self,
        trt: &TensorRt,
        key: &str,
        gpu: &GpuIdentity,
        reason: &str,
        device: &str,
    ) -> Result<CheckedEngine, PlanError> {
        let shared = &self.shared;
        let pipeline_error = |reason: String| PlanError::Pipeline {
            device: device.to_string(),
            reason,
        };
        let model = shared
            .model_files
            .iter()
            .find(|m| m.key == key)
            .ok_or_else(|| pipeline_error(format!("no model file for `{key}`")))?;
        let options = shared
            .build
            .as_ref()
            .ok_or_else(|| pipeline_error(reason.to_string()))?;
        let _one_build = shared.one_build.lock().unwrap_or_else(|p| p.into_inner());
        if let Ok(checked) = shared.store.find(model, gpu, trt.version()) {
            return Ok(checked);
        }
        tracing::info!(
            device,
            model = %model.path.display(),
            why = reason,
            precision = %options.precision,
            "building the TensorRT engine (this takes minutes; /ping answers 503 until it is done)"
        );
        let stored = build_and_store(
            trt,
            &shared.store,
            model,
            gpu,
            shared.driver_cuda_version.clone(),
            options,
            &|_| {},
        )
        .map_err(|source| PlanError::Build {
            device: device.to_string(),
            model: model.path.clone(),
            source: Box::new(source),
        })?;
        tracing::info!(
            device,
            plan = %stored.engine.plan.display(),
            seconds = format!("{:.1}", stored.build_time.as_secs_f64()),
            "engine built"
        );
        Ok(stored.engine)
    }
}

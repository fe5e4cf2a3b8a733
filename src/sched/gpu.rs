//! GPU devices for `celer serve` and `celer run`. Before the server listens, `plan_gpus`
//! decides per GPU what runs the models (`tensorrt::select`), refusing plans that do not
//! fit. Then, on each GPU, whichever replica starts first opens the device (context,
//! kernels) and deserialises each engine once, building it first when asked to; every
//! replica then makes its own stream, buffers and execution contexts. While that runs the
//! router reports `Loading`, so `/ping` answers 503 until every replica is ready.

use std::path::Path;
use std::sync::{Arc, Mutex};

use image::RgbImage;

use super::device::Device;
use super::executor::{probe_image, BoxedPipelineExecutor, ExecError, Executor};
use super::executor::{PipelineJob, PipelineOutput};
use super::router::{DeviceSetup, LoadFn};
use crate::config::{BatchingSpec, PipelineSpec};
use crate::cuda::{CudaError, GpuDevice, GpuInfo, GpuLimits, GpuPipeline, ModelSource};
use crate::pipeline::StageTimings;
use crate::tensorrt::manifest::{CheckedEngine, GpuIdentity};
use crate::tensorrt::select::{choose_engines, EngineChoice, GpuModels, ModelRef};
use crate::tensorrt::store::{
    build_and_store, choose_precision, BuildOptions, EngineStore, ModelFile,
};
use crate::tensorrt::{Engine, TensorRt};

/// What one GPU's replicas start from, decided before the server listens.
pub struct GpuPlan {
    pub info: GpuInfo,
    pub models: GpuModels,
    shared: Arc<EngineContext>,
}

/// What every GPU of the process shares: TensorRT (when loaded), the pipeline's model
/// files, where engines are stored and how missing ones are built.
struct EngineContext {
    tensorrt: Option<TensorRt>,
    model_files: Vec<ModelFile>,
    store: EngineStore,
    /// `Some` with `--build-engines`.
    build: Option<BuildOptions>,
    driver_cuda_version: Option<String>,
}

/// Decides, for each of `gpus`, where the models of `spec` run from. TensorRT is loaded
/// once (with its ONNX parser when `build_engines`); when it cannot be, every GPU runs
/// the models with ONNX Runtime, and the log says why, once. Every plan that does not fit
/// is reported together, each with the `celer build` command that fixes it.
pub fn plan_gpus(
    spec: &PipelineSpec,
    model_dir: &Path,
    gpus: &[GpuInfo],
    build_engines: bool,
    driver_cuda_version: Option<String>,
) -> Result<Vec<GpuPlan>, String> {
    let model_files = ModelFile::of_pipeline(spec).map_err(|e| e.to_string())?;
    let tensorrt = if build_engines {
        TensorRt::load_builder()
    } else {
        TensorRt::load_runtime()
    };
    let build = match (&tensorrt, build_engines) {
        (Ok(trt), true) => Some(BuildOptions {
            precision: choose_precision(trt.version().major, None)
                .map_err(|e| e.to_string())?
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
    let shared = Arc::new(EngineContext {
        tensorrt: tensorrt.as_ref().ok().cloned(),
        model_files,
        store: EngineStore::new(model_dir, None),
        build,
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
        match choose_engines(version, &info.identity(), model_dir, &refs, build_engines) {
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
        Err(refused.join("\n"))
    }
}

/// A GPU opened, and its engines deserialised: shared by its replicas. Fields drop in
/// order, the engines before the device whose context holds their memory.
struct LoadedGpu {
    segmentation: Option<Arc<Engine>>,
    matting: Option<Arc<Engine>>,
    device: Arc<GpuDevice>,
}

/// Where a GPU is in its life.
enum Opening {
    /// Not opened yet, or closed by a recovery.
    Closed,
    Open(Arc<LoadedGpu>),
    /// Opening failed; every replica gets the same answer.
    Failed(String),
}

/// One GPU and its replicas' pipelines. A CUDA context is shared by every replica of a
/// GPU, so when it is lost (a sticky error) it is lost for all of them: recovery empties
/// every replica's slot and drops the GPU, which destroys the context with its last
/// reference, then opens the GPU again and reloads each replica.
struct GpuReplicas {
    spec: PipelineSpec,
    plan: GpuPlan,
    name: String,
    ort_threads: usize,
    limits: GpuLimits,
    /// The opened GPU, and the generation of its context (one more per recovery).
    opened: Mutex<(u64, Opening)>,
    /// One slot per replica, held while that replica runs: its pipeline (stream, buffers,
    /// execution contexts), emptied while the GPU is reopened.
    pipelines: Vec<Mutex<Option<GpuPipeline>>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock only means a replica panicked while holding it; the data is whole
    // (a pipeline is dropped, not half-written, by an unwinding run).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl GpuReplicas {
    /// The opened GPU and its generation, opening it (and loading or building its
    /// engines) if nobody has: the first replica does it while the others wait.
    fn gpu(&self) -> Result<(u64, Arc<LoadedGpu>), String> {
        let mut opened = lock(&self.opened);
        let generation = opened.0;
        match &opened.1 {
            Opening::Open(gpu) => Ok((generation, gpu.clone())),
            Opening::Failed(e) => Err(e.clone()),
            Opening::Closed => match load_gpu(&self.spec, &self.plan, &self.name) {
                Ok(gpu) => {
                    let gpu = Arc::new(gpu);
                    opened.1 = Opening::Open(gpu.clone());
                    Ok((generation, gpu))
                }
                Err(e) => {
                    opened.1 = Opening::Failed(e.clone());
                    Err(e)
                }
            },
        }
    }

    fn generation(&self) -> u64 {
        lock(&self.opened).0
    }

    /// A new pipeline for one replica on the opened GPU: its own stream, buffers and
    /// execution contexts.
    fn load_pipeline(&self, gpu: &LoadedGpu) -> Result<GpuPipeline, ExecError> {
        let source = match &gpu.segmentation {
            Some(segmentation) => ModelSource::TensorRt {
                segmentation,
                matting: gpu.matting.as_ref(),
            },
            None => ModelSource::OnnxRuntime {
                intra_threads: self.ort_threads,
            },
        };
        Ok(GpuPipeline::load(
            &self.spec,
            gpu.device.clone(),
            source,
            self.limits,
        )?)
    }

    /// Reopens the GPU after its context was lost in generation `lost_in`: nothing when
    /// another replica already did (and it worked). Waits for the runs in flight on the other replicas
    /// (they fail fast in a lost context), drops every pipeline and the GPU, opens it
    /// again and reloads every replica.
    fn recover(&self, lost_in: u64) -> Result<(), ExecError> {
        // Slots first, then the GPU: the order every path takes.
        let mut slots: Vec<_> = self.pipelines.iter().map(lock).collect();
        {
            let mut opened = lock(&self.opened);
            let recovered_since = opened.0 != lost_in
                && matches!(opened.1, Opening::Open(_))
                && slots.iter().all(|slot| slot.is_some());
            if recovered_since {
                return Ok(());
            }
            for slot in slots.iter_mut() {
                **slot = None;
            }
            // The last references to the context go here: the driver destroys it.
            opened.1 = Opening::Closed;
            opened.0 += 1;
        }
        let (_, gpu) = self.gpu()?;
        for slot in slots.iter_mut() {
            **slot = Some(self.load_pipeline(&gpu)?);
        }
        Ok(())
    }
}

/// The setup of `plan`'s GPU: `replicas` replicas, with `ort_threads` ONNX Runtime
/// threads each where TensorRT is absent, images up to `limits`.
pub fn gpu_device_setup(
    spec: &PipelineSpec,
    plan: GpuPlan,
    replicas: usize,
    ort_threads: usize,
    limits: GpuLimits,
) -> DeviceSetup<BoxedPipelineExecutor> {
    let name = Device::Gpu(plan.info.ordinal as u32).to_string();
    let replicas = replicas.max(1);
    let shared = Arc::new(GpuReplicas {
        spec: spec.clone(),
        plan,
        name: name.clone(),
        ort_threads,
        limits,
        opened: Mutex::new((0, Opening::Closed)),
        pipelines: (0..replicas).map(|_| Mutex::new(None)).collect(),
    });
    let load: LoadFn<BoxedPipelineExecutor> = Arc::new(move |replica| {
        // The first replica opens the GPU and loads (or builds) the engines; the others
        // wait for it and share the result.
        let (generation, gpu) = shared.gpu().map_err(ExecError::from)?;
        let pipeline = shared.load_pipeline(&gpu)?;
        let backend = pipeline.model_backend();
        let slot = shared
            .pipelines
            .get(replica)
            .ok_or_else(|| format!("{}: no slot for replica {replica}", shared.name))?;
        *lock(slot) = Some(pipeline);
        tracing::info!(device = %shared.name, replica, models = backend, "GPU replica ready");
        Ok(Box::new(GpuExecutor {
            shared: shared.clone(),
            replica,
            lost_in: generation,
            probe_image: probe_image(),
        }) as BoxedPipelineExecutor)
    });
    DeviceSetup {
        name,
        replicas,
        // A GPU replica runs one image at a time: gathering a batch would only take
        // requests off the queue that the device's other replicas could be running.
        batching: BatchingSpec::OFF,
        load,
    }
}

/// Builds run one at a time in the process: two GPUs of one model would otherwise build
/// the same engine twice, and a build already uses the whole GPU.
static BUILDS: Mutex<()> = Mutex::new(());

fn load_gpu(spec: &PipelineSpec, plan: &GpuPlan, device: &str) -> Result<LoadedGpu, String> {
    let gpu = GpuDevice::open(plan.info.clone())
        .map_err(|e| format!("{device} ({}): {e}", plan.info.name))?;
    gpu.context()
        .bind_to_thread()
        .map_err(|e| format!("{device}: {e:?}"))?;
    let GpuModels::TensorRt { version, engines } = &plan.models else {
        return Ok(LoadedGpu {
            segmentation: None,
            matting: None,
            device: gpu,
        });
    };
    let shared = &plan.shared;
    let trt = shared
        .tensorrt
        .as_ref()
        .ok_or_else(|| format!("{device}: TensorRT {version} was chosen but is not loaded"))?;
    let runtime = trt.runtime().map_err(|e| format!("{device}: {e}"))?;
    let identity = plan.info.identity();
    let mut loaded = LoadedGpu {
        segmentation: None,
        matting: None,
        device: gpu.clone(),
    };
    for (key, choice) in engines {
        let checked = match choice {
            EngineChoice::Stored(checked) => (**checked).clone(),
            EngineChoice::Build { reason } => {
                build_engine(shared, trt, key, &identity, reason, device)?
            }
        };
        let bytes = std::fs::read(&checked.plan)
            .map_err(|e| format!("{device}: cannot read {}: {e}", checked.plan.display()))?;
        let engine = runtime
            .deserialize(&bytes)
            .map_err(|e| format!("{device}: {}: {e}", checked.plan.display()))?;
        tracing::info!(
            device,
            model = %key,
            plan = %checked.plan.display(),
            precision = %checked.manifest.precision,
            mib = format!("{:.1}", bytes.len() as f64 / f64::from(1 << 20)),
            "engine loaded"
        );
        match key.as_str() {
            "segmentation" => loaded.segmentation = Some(engine),
            "matting" => loaded.matting = Some(engine),
            other => return Err(format!("{device}: unknown model `{other}` of the pipeline")),
        }
    }
    if loaded.segmentation.is_none() {
        return Err(format!(
            "{device}: no segmentation engine for {}",
            spec.source.display()
        ));
    }
    Ok(loaded)
}

/// Builds the engine of model `key` for this GPU (`--build-engines`), unless another GPU
/// of the same model built it meanwhile.
fn build_engine(
    shared: &EngineContext,
    trt: &TensorRt,
    key: &str,
    gpu: &GpuIdentity,
    reason: &str,
    device: &str,
) -> Result<CheckedEngine, String> {
    let model = shared
        .model_files
        .iter()
        .find(|m| m.key == key)
        .ok_or_else(|| format!("{device}: no model file for `{key}`"))?;
    let options = shared
        .build
        .as_ref()
        .ok_or_else(|| format!("{device}: {reason}"))?;
    let _one_build = BUILDS.lock().unwrap_or_else(|p| p.into_inner());
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
    .map_err(|e| format!("{device}: building {}: {e}", model.path.display()))?;
    tracing::info!(
        device,
        plan = %stored.engine.plan.display(),
        seconds = format!("{:.1}", stored.build_time.as_secs_f64()),
        "engine built"
    );
    Ok(stored.engine)
}

/// One replica of the pipeline on a GPU: its slot in the GPU's `GpuReplicas`.
pub struct GpuExecutor {
    shared: Arc<GpuReplicas>,
    replica: usize,
    /// The GPU generation of the last run that found the device lost.
    lost_in: u64,
    probe_image: RgbImage,
}

impl GpuExecutor {
    fn run_one(&mut self, job: &PipelineJob) -> Result<PipelineOutput, ExecError> {
        let mut slot = lock(&self.shared.pipelines[self.replica]);
        let generation = self.shared.generation();
        let pipeline = slot.as_mut().ok_or_else(|| {
            format!(
                "{} replica {}: not loaded (the GPU is being reopened)",
                self.shared.name, self.replica
            )
        })?;
        let mut timings = job.timings;
        match pipeline.run(&job.image, job.want_cutout, &mut timings) {
            Ok(done) => Ok(PipelineOutput {
                matte: done.matte,
                cutout: done.cutout,
                timings,
            }),
            Err(e) => {
                if e.is_device_lost() {
                    self.lost_in = generation;
                }
                Err(e.into())
            }
        }
    }
}

impl Executor for GpuExecutor {
    type Input = PipelineJob;
    type Output = PipelineOutput;

    /// One image at a time: the replica's buffers are sized for one; the device's other
    /// replicas overlap their copies and kernels with this one's.
    fn run_batch(&mut self, inputs: &[&PipelineJob]) -> Result<Vec<PipelineOutput>, ExecError> {
        inputs.iter().map(|job| self.run_one(job)).collect()
    }

    fn probe(&mut self) -> Result<(), ExecError> {
        let job = PipelineJob {
            image: Arc::new(self.probe_image.clone()),
            timings: StageTimings::default(),
            want_cutout: false,
        };
        self.run_one(&job).map(|_| ())
    }

    /// A lost context, or a replica left without a pipeline by a recovery that failed
    /// (so the next failed probe tries again).
    fn device_lost(&self, error: &ExecError) -> bool {
        error
            .downcast_ref::<CudaError>()
            .is_some_and(CudaError::is_device_lost)
            || lock(&self.shared.pipelines[self.replica]).is_none()
    }

    fn recover(&mut self) -> Result<(), ExecError> {
        self.shared.recover(self.lost_in)
    }
}

//! A GPU replica: the GPU stages of a request on one stream (`stages`, with one file
//! per stage: `input`, `model`, `mask`, `matting`, `transfer`, `clock`, and the leaves
//! they share: `buffers`, `error`), and the `Executor` the scheduler runs it through.
//! Whichever replica of a GPU starts first opens the device (context, kernels) and loads
//! its engines (`crate::engines::plan`); every replica then makes its own stream, buffers
//! and execution contexts. A GPU whose context is lost is reopened here, for all its
//! replicas at once (`GpuReplicas`), or, where TensorRT's state is in that context or a
//! replica is stuck on it, left alone for good for the process to restart.

mod buffers;
mod clock;
mod error;
mod input;
mod mask;
mod matting;
pub mod model;
mod stages;
mod transfer;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub use buffers::GpuLimits;
pub use error::{GpuError, OpenError};
pub use model::ModelSource;
pub use stages::{GpuStages, ThreadCpuClock};

use super::{health_check_job, warmup_image, BoxedMatteExecutor, MatteJob, MatteOutput};
use crate::cuda::{GpuDevice, HostPool};
use crate::engines::plan::{GpuEngines, GpuPlan};
use crate::matte::{Planes, StageTimings};
use crate::pixels::{HostAlloc, RgbPixels};
use crate::sched::{
    Device, DeviceSetup, ExecError, Executor, LoadFn, Recovery, RunParts, WarmRun, Work,
};
use crate::spec::{BatchingSpec, PipelineSpec};

/// A GPU opened, with its engines deserialised and the host pool page-locked in its
/// context: shared by its replicas.
struct LoadedGpu {
    /// `None` where the models run on ONNX Runtime.
    engines: Option<GpuEngines>,
    device: Arc<GpuDevice>,
    pool: HostPool,
}

impl LoadedGpu {
    /// One replica's stages on this GPU: its own stream, buffers and execution contexts,
    /// the models from the engines (ONNX Runtime with `ort_threads` where there are none).
    fn load_stages(
        &self,
        spec: &PipelineSpec,
        ort_threads: usize,
        serving: &GpuServing,
    ) -> Result<GpuStages, GpuError> {
        let source = match &self.engines {
            Some(engines) => ModelSource::TensorRt {
                segmentation: &engines.segmentation,
                matting: engines.matting.as_ref(),
            },
            None => ModelSource::OnnxRuntime {
                intra_threads: ort_threads,
            },
        };
        let blocks = Arc::new(self.pool.clone());
        let mut stages =
            GpuStages::load(spec, self.device.clone(), source, serving.limits, blocks)?;
        stages.warm_up_at(&serving.warmup)?;
        Ok(stages)
    }
}

impl Drop for LoadedGpu {
    fn drop(&mut self) {
        // Engines hold device memory of the GPU's context: they go before the device
        // (whose last reference destroys the context), whatever the fields' order.
        self.engines = None;
    }
}

/// Where a GPU is in its life.
enum Opening {
    /// Not opened yet, or closed by a recovery.
    Closed,
    Open(Arc<LoadedGpu>),
    /// Opening failed; every replica gets the same answer.
    Failed(Arc<OpenError>),
}

/// What every GPU of a server is set up with.
#[derive(Clone)]
pub struct GpuServing {
    /// The largest image the device buffers hold.
    pub limits: GpuLimits,
    /// The server's page-locked host blocks, which its decoders lease from too.
    pub pool: HostPool,
    /// Image sizes each replica runs once at load, after the small warm-up every replica
    /// runs: the sizes the first requests will be (`--warmup-size`), whose first run
    /// would otherwise pay the making of its resize tables and the first launches of
    /// kernels at its grid sizes. The tables of the last stay in place.
    pub warmup: Vec<(u32, u32)>,
}

impl GpuServing {
    /// Images up to `limits`, pixels in `pool`, no warm-up beyond the small one.
    pub fn new(limits: GpuLimits, pool: HostPool) -> Self {
        Self {
            limits,
            pool,
            warmup: Vec::new(),
        }
    }
}

/// Host blocks lent to a request at once, at most: its decoded image, and the cut-out
/// (or alpha) it downloads.
const BLOCKS_PER_REQUEST: usize = 2;

/// The pixels of a 1920x1080 frame: the blocks made at start-up each hold its RGBA
/// cut-out (8.3 MB).
pub const DEFAULT_BLOCK_PIXELS: u64 = 1920 * 1080;

/// The pixels of a 12 MP photo (4032x3024, a phone camera's): the pool made at start-up
/// holds, for each GPU replica, a block for such a request's RGB8 pixels (36.6 MB) and
/// one for its RGBA answer (48.8 MB), so that one after smaller requests pins nothing
/// while it runs and its download is DMA.
pub const LARGE_REQUEST_PIXELS: u64 = 4032 * 3024;

/// Bytes of `n` as a block size.
fn block_len(n: u64) -> usize {
    usize::try_from(n).unwrap_or(usize::MAX)
}

/// The page-locked host pool a server's decoders and GPU replicas share, for
/// `gpu_replicas` replicas in all and images up to `max_pixels`, made at start-up:
/// - blocks for two requests per replica (one on the GPU, one decoding or encoding beside
///   it), each holding a `block_pixels` RGBA plane (at most `max_pixels`);
/// - for each replica, a block for the RGB8 pixels and one for the RGBA answer of a
///   `LARGE_REQUEST_PIXELS` request (at most `max_pixels`; none where the blocks above
///   already hold it).
///
/// A lease the free blocks cannot serve grows the pool in the background, by a block of
/// 1.5 times the lease; the ceiling leaves room for each replica to grow the two blocks
/// of one `max_pixels` request that way, so that any image the decoder accepts is, after
/// its first request, served from page-locked blocks.
pub fn host_pool(gpu_replicas: usize, max_pixels: u64, block_pixels: u64) -> HostPool {
    let replicas = gpu_replicas.max(1);
    let block_pixels = block_pixels.min(max_pixels);
    let mut blocks = vec![block_len(4 * block_pixels); 2 * BLOCKS_PER_REQUEST * replicas];
    let large = LARGE_REQUEST_PIXELS.min(max_pixels);
    if large > block_pixels {
        for _ in 0..replicas {
            blocks.push(block_len(3 * large));
            blocks.push(block_len(4 * large));
        }
    }
    let made = blocks.iter().fold(0usize, |a, b| a.saturating_add(*b));
    let growth = block_len(7 * max_pixels)
        .saturating_mul(3)
        .saturating_div(2)
        .saturating_mul(replicas);
    HostPool::with_blocks(&blocks, made.saturating_add(growth))
}

/// One GPU and its replicas' stages. A CUDA context is shared by every replica of a
/// GPU, so when it is lost (a sticky error) it is lost for all of them: recovery empties
/// every replica's slot and drops the GPU, which destroys the context with its last
/// reference (or resets it, where TensorRT holds one of its own), then opens the GPU
/// again and reloads each replica.
struct GpuReplicas {
    spec: PipelineSpec,
    plan: GpuPlan,
    name: String,
    ort_threads: usize,
    serving: GpuServing,
    /// The opened GPU, and the generation of its context (one more per recovery).
    opened: Mutex<(u64, Opening)>,
    /// One slot per replica, held while that replica runs: its stages (stream, buffers,
    /// execution contexts), emptied while the GPU is reopened.
    stages: Vec<Mutex<Option<GpuStages>>>,
    /// Set when the GPU was lost where it cannot come back in this process (TensorRT's
    /// state in the lost context, or a replica stuck on it): no call is made on the GPU
    /// again, and its stages, engines and context are never dropped (`Drop`).
    lost_for_good: AtomicBool,
}

/// How long a recovery waits for a replica's run to leave its slot. A run in a lost
/// context fails fast; one still running after this is stuck on the GPU (a hung kernel on
/// a GPU without a watchdog), and the GPU cannot be recovered in this process.
const SLOT_WAIT: Duration = Duration::from_secs(5);

impl Drop for GpuReplicas {
    fn drop(&mut self) {
        if !*self.lost_for_good.get_mut() {
            return;
        }
        // Leaked on purpose: dropping them would call CUDA and TensorRT in the lost
        // context (destroying execution contexts, engines, streams, the runtime), which
        // the CUDA runtime inside TensorRT forbids once its context is lost: the process
        // must be terminated and relaunched to use CUDA again, and it is about to exit.
        for slot in &mut self.stages {
            let stages = slot.get_mut().unwrap_or_else(|p| p.into_inner()).take();
            std::mem::forget(stages);
        }
        let opened = std::mem::replace(
            &mut self.opened.get_mut().unwrap_or_else(|p| p.into_inner()).1,
            Opening::Closed,
        );
        std::mem::forget(opened);
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    // A poisoned lock only means a replica panicked while holding it; the data is whole
    // (the stages are dropped, not half-written, by an unwinding run).
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl GpuReplicas {
    /// The opened GPU and its generation, opening it (and loading or building its
    /// engines) if nobody has: the first replica does it while the others wait.
    fn gpu(&self) -> Result<(u64, Arc<LoadedGpu>), GpuError> {
        let mut opened = lock(&self.opened);
        let generation = opened.0;
        match &opened.1 {
            Opening::Open(gpu) => Ok((generation, gpu.clone())),
            Opening::Failed(e) => Err(GpuError::Open(e.clone())),
            Opening::Closed => {
                match load_gpu(&self.spec, &self.plan, &self.name, &self.serving.pool) {
                    Ok(gpu) => {
                        let gpu = Arc::new(gpu);
                        opened.1 = Opening::Open(gpu.clone());
                        Ok((generation, gpu))
                    }
                    Err(e) => {
                        let e = Arc::new(e);
                        opened.1 = Opening::Failed(e.clone());
                        Err(GpuError::Open(e))
                    }
                }
            }
        }
    }

    fn generation(&self) -> u64 {
        lock(&self.opened).0
    }

    /// New stages for one replica on the opened GPU: its own stream, buffers and
    /// execution contexts.
    fn load_stages(&self, gpu: &LoadedGpu) -> Result<GpuStages, ExecError> {
        Ok(gpu.load_stages(&self.spec, self.ort_threads, &self.serving)?)
    }

    /// Reopens the GPU after its context was lost in generation `lost_in`: nothing when
    /// another replica already did (and it worked). Waits for the runs in flight on the other replicas
    /// (they fail fast in a lost context), drops every replica's stages and the GPU, opens it
    /// again and reloads every replica.
    fn recover(&self, lost_in: u64) -> Result<Recovery, ExecError> {
        if let Some(why) = self.cannot_come_back() {
            return Ok(Recovery::NeedsRestart(why));
        }
        // Slots first, then the GPU: the order every path takes.
        let mut slots = Vec::with_capacity(self.stages.len());
        for (replica, slot) in self.stages.iter().enumerate() {
            match lock_within(slot, SLOT_WAIT) {
                Some(guard) => slots.push(guard),
                None => {
                    self.lost_for_good.store(true, Ordering::Release);
                    return Ok(Recovery::NeedsRestart(format!(
                        "replica {replica}'s run has not left the lost GPU after {}s (stuck in a \
                         synchronisation on a hung GPU): it cannot be recovered in this process",
                        SLOT_WAIT.as_secs()
                    )));
                }
            }
        }
        {
            let mut opened = lock(&self.opened);
            let recovered_since = opened.0 != lost_in
                && matches!(opened.1, Opening::Open(_))
                && slots.iter().all(|slot| slot.is_some());
            if recovered_since {
                return Ok(Recovery::AlreadyReopened);
            }
            for slot in slots.iter_mut() {
                **slot = None;
            }
            // celer's last references to the context go here (engines first: LoadedGpu's
            // Drop); without another holder the driver destroys the context.
            opened.1 = Opening::Closed;
            opened.0 += 1;
        }
        // TensorRT keeps its own reference to the primary context: the lost context then
        // survives celer's references, and must be reset to be destroyed.
        match crate::cuda::device::reset_if_held(self.plan.info.ordinal) {
            Ok(true) => tracing::warn!(
                device = %self.name,
                "the lost context outlived celer's references (TensorRT holds one): reset it"
            ),
            Ok(false) => {}
            Err(source) => {
                return Err(GpuError::Reset {
                    device: self.name.clone(),
                    source,
                }
                .into())
            }
        }
        let (_, gpu) = self.gpu()?;
        for slot in slots.iter_mut() {
            **slot = Some(self.load_stages(&gpu)?);
        }
        Ok(Recovery::Reopened)
    }
}

impl GpuReplicas {
    /// Why the lost GPU cannot come back in this process, if it cannot: TensorRT's CUDA
    /// runtime keeps state in its context (its engines were deserialised there), and after
    /// a sticky error (or a reset) that state is unusable until the process is relaunched.
    /// Marks it so: no call is made on it again. Takes the GPU's lock alone (no slot), so
    /// that a replica stuck in a run does not hold it up.
    fn cannot_come_back(&self) -> Option<String> {
        if self.lost_for_good.load(Ordering::Acquire) {
            return Some("it was already found unrecoverable in this process".to_string());
        }
        let opened = lock(&self.opened);
        let gpu = match &opened.1 {
            Opening::Open(gpu) if gpu.engines.is_some() => gpu,
            _ => return None,
        };
        self.lost_for_good.store(true, Ordering::Release);
        // The pool would page-lock its next blocks in the lost context too.
        gpu.pool.detach(gpu.device.context());
        Some(
            "TensorRT's engines live in its lost context, and the CUDA runtime inside TensorRT \
             needs the process terminated and relaunched to use CUDA again: no further call is \
             made on the GPU"
                .to_string(),
        )
    }
}

/// `slot`'s lock within `wait`, polled (a `Mutex` has no timed lock); `None` when its holder
/// keeps it longer.
fn lock_within<T>(slot: &Mutex<T>, wait: Duration) -> Option<std::sync::MutexGuard<'_, T>> {
    let until = Instant::now() + wait;
    loop {
        match slot.try_lock() {
            Ok(guard) => return Some(guard),
            Err(std::sync::TryLockError::Poisoned(p)) => return Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) if Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(std::sync::TryLockError::WouldBlock) => return None,
        }
    }
}

/// The setup of `plan`'s GPU: `replicas` replicas, with `ort_threads` ONNX Runtime
/// threads each where TensorRT is absent, set up as `serving` says.
pub fn gpu_device_setup(
    spec: &PipelineSpec,
    plan: GpuPlan,
    replicas: usize,
    ort_threads: usize,
    serving: GpuServing,
) -> DeviceSetup<BoxedMatteExecutor> {
    let name = Device::Gpu(plan.info.ordinal as u32).to_string();
    let replicas = replicas.max(1);
    let shared = Arc::new(GpuReplicas {
        spec: spec.clone(),
        plan,
        name: name.clone(),
        ort_threads,
        serving,
        opened: Mutex::new((0, Opening::Closed)),
        stages: (0..replicas).map(|_| Mutex::new(None)).collect(),
        lost_for_good: AtomicBool::new(false),
    });
    let load: LoadFn<BoxedMatteExecutor> = Arc::new(move |replica| {
        // The first replica opens the GPU and loads (or builds) the engines; the others
        // wait for it and share the result.
        let (generation, gpu) = shared.gpu()?;
        let stages = shared.load_stages(&gpu)?;
        let backend = stages.model_backend();
        let slot = shared.stages.get(replica).ok_or_else(|| GpuError::NoSlot {
            device: shared.name.clone(),
            replica,
        })?;
        *lock(slot) = Some(stages);
        tracing::info!(device = %shared.name, replica, models = backend, "GPU replica ready");
        Ok(Box::new(GpuExecutor {
            shared: shared.clone(),
            replica,
            lost_in: generation,
        }) as BoxedMatteExecutor)
    });
    DeviceSetup {
        name,
        replicas,
        // A GPU replica runs one image at a time: gathering a batch would only take
        // requests off the queue that the device's other replicas could be running.
        batching: BatchingSpec::OFF,
        load,
        interim: false,
    }
}

/// One replica of a GPU outside a server, for `celer bench local --gpu`: the GPU opened,
/// its engines loaded, and one replica's stages on them.
pub struct SoloReplica {
    // Declared first, so dropped first: the stages' buffers and execution contexts go
    // before the engines and the device they live in.
    stages: GpuStages,
    _gpu: LoadedGpu,
}

impl SoloReplica {
    /// Opens `plan`'s GPU and loads one replica (models on ONNX Runtime with
    /// `ort_threads` where the plan has no engines), set up as `serving` says.
    pub fn open(
        spec: &PipelineSpec,
        plan: &GpuPlan,
        ort_threads: usize,
        serving: &GpuServing,
    ) -> Result<Self, GpuError> {
        let name = Device::Gpu(plan.info.ordinal as u32).to_string();
        let gpu =
            load_gpu(spec, plan, &name, &serving.pool).map_err(|e| GpuError::Open(Arc::new(e)))?;
        let stages = gpu.load_stages(spec, ort_threads, serving)?;
        Ok(Self { stages, _gpu: gpu })
    }

    pub fn stages(&mut self) -> &mut GpuStages {
        &mut self.stages
    }
}

/// Opens the GPU of `plan`, page-locks `pool` in its context and loads its engines (none
/// where its models run on ONNX Runtime).
fn load_gpu(
    spec: &PipelineSpec,
    plan: &GpuPlan,
    device: &str,
    pool: &HostPool,
) -> Result<LoadedGpu, OpenError> {
    let gpu = GpuDevice::open(plan.info.clone()).map_err(|source| OpenError::Device {
        device: device.to_string(),
        name: plan.info.name.clone(),
        source,
    })?;
    gpu.context()
        .bind_to_thread()
        .map_err(|source| OpenError::Bind {
            device: device.to_string(),
            source,
        })?;
    pool.attach(gpu.context());
    let engines = plan.load_engines(spec, &gpu, device)?;
    Ok(LoadedGpu {
        engines,
        device: gpu,
        pool: pool.clone(),
    })
}

/// One replica of the pipeline on a GPU: its slot in the GPU's `GpuReplicas`.
pub struct GpuExecutor {
    shared: Arc<GpuReplicas>,
    replica: usize,
    /// The GPU generation of the last run that found the device lost.
    lost_in: u64,
}

impl GpuExecutor {
    fn run_one(&mut self, job: &MatteJob) -> Result<MatteOutput, ExecError> {
        let mut slot = lock(&self.shared.stages[self.replica]);
        if self.shared.lost_for_good.load(Ordering::Acquire) {
            // Not a call on the GPU again: it is out of service until the process restarts.
            return Err(ExecError::device_lost(GpuError::LostForGood {
                device: self.shared.name.clone(),
            }));
        }
        let generation = self.shared.generation();
        // Emptied by a recovery, which left it so when it failed: the device is still
        // lost, so that the next failed health check tries the recovery again.
        let Some(stages) = slot.as_mut() else {
            return Err(ExecError::device_lost(GpuError::NotLoaded {
                device: self.shared.name.clone(),
                replica: self.replica,
            }));
        };
        let mut timings = job.timings;
        match stages.run(&job.image, job.planes, &mut timings) {
            Ok(planes) => Ok(MatteOutput { planes, timings }),
            Err(e) if e.is_device_lost() => {
                self.lost_in = generation;
                Err(ExecError::device_lost(e))
            }
            Err(e) => Err(e.into()),
        }
    }
}

impl Executor for GpuExecutor {
    type Input = MatteJob;
    type Output = MatteOutput;

    /// One image at a time: the replica's buffers are sized for one; the device's other
    /// replicas overlap their copies and kernels with this one's.
    fn run_batch(&mut self, inputs: &[&MatteJob]) -> Result<Vec<MatteOutput>, ExecError> {
        inputs.iter().map(|job| self.run_one(job)).collect()
    }

    fn parts(&self, output: &MatteOutput) -> Option<RunParts> {
        Some(output.run_parts())
    }

    fn health_check(&mut self) -> Result<(), ExecError> {
        self.run_one(&health_check_job()).map(|_| ())
    }

    /// Each warm-up size once more, timed, every plane: its first run was the load's
    /// (`GpuStages::warm_up_at`), which made its resize tables and paid for the first
    /// launches at its grid sizes. The pixels are in a block of the page-locked pool, as a
    /// decoded request's are, so that the upload is timed as a request's. The device's
    /// first prices come from these runs, not from the first requests.
    fn warm_up(&mut self) -> Result<Vec<WarmRun>, ExecError> {
        let sizes = self.shared.serving.warmup.clone();
        let mut timed = Vec::with_capacity(sizes.len());
        for (w, h) in sizes {
            let image = warmup_image(w, h);
            let mut bytes = self.shared.serving.pool.alloc(image.as_raw().len());
            bytes.copy_from_slice(image.as_raw());
            let Some(pixels) = RgbPixels::from_raw(w, h, bytes) else {
                continue;
            };
            let job = MatteJob::new(Arc::new(pixels), StageTimings::default(), Planes::ALL);
            let start = Instant::now();
            let output = self.run_one(&job)?;
            timed.push(WarmRun {
                work: Work::of_image(w, h, true),
                took: start.elapsed(),
                parts: Some(output.run_parts()),
            });
        }
        Ok(timed)
    }

    fn recover(&mut self) -> Result<Recovery, ExecError> {
        self.shared.recover(self.lost_in)
    }

    /// A run past its deadline on a GPU is a kernel or a copy that has not ended: nothing
    /// on the host can interrupt it (a datacenter GPU has no watchdog), and a recovery
    /// would wait on it forever.
    fn stuck_is_lost(&self) -> bool {
        true
    }
}

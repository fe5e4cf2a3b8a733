//! Options of `celer serve` (and the runtime options `celer run` shares), from flags or
//! the environment. SageMaker's own variables are honoured where they mean the same
//! thing: `SAGEMAKER_BIND_TO_PORT`, `SAGEMAKER_MODEL_SERVER_WORKERS`,
//! `SAGEMAKER_MODEL_SERVER_TIMEOUT`, and a transform job's (see `hosting`).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::hosting::{BatchJob, Explicit, HostingArgs, HostingPlan};
use crate::codec::decode::DecodeLimits;
use crate::host::cpus::CpuBudget;
use crate::sched::{DeviceSelection, QueueBudget, RouterConfig, Routing};

/// How many replicas, with how many ONNX Runtime threads each.
#[derive(Debug, Clone, Args)]
pub struct RuntimeArgs {
    /// Model directory holding celer.toml and the ONNX files (SageMaker unpacks the
    /// model archive to /opt/ml/model).
    #[arg(long, env = "CELER_MODEL_DIR", default_value = "/opt/ml/model")]
    pub model_dir: PathBuf,

    /// Pipeline replicas per device, each on its own thread with its own sessions (or
    /// execution contexts). Default: on the CPU, as many as keep replicas x threads
    /// within the cores (the container's CPU quota, not the host's count); on a GPU, 2
    /// (one copies while the other computes); serverless hosting 1.
    #[arg(long, env = "SAGEMAKER_MODEL_SERVER_WORKERS")]
    pub replicas: Option<usize>,

    /// ONNX Runtime intra-op threads per replica. Default: cores / replicas, the cores
    /// being the container's CPU quota.
    #[arg(long, env = "CELER_THREADS_PER_REPLICA")]
    pub threads_per_replica: Option<usize>,

    /// ONNX Runtime threads for a request that runs while no other replica of the CPU
    /// does: one more set of sessions with this many threads is lent to it, so that a
    /// lone request uses every core. Default: the cores (the container's CPU quota); no
    /// more than --threads-per-replica turns it off.
    #[arg(long, env = "CELER_SOLO_THREADS")]
    pub solo_threads: Option<usize>,
}

/// Which devices `celer serve` and `celer run` start, and what a GPU may do at start-up.
#[derive(Debug, Clone, Args)]
pub struct DeviceArgs {
    /// Devices to run on: `auto` (every GPU found, else the CPU), `cpu`, or GPU
    /// ordinals such as `0,1`. A GPU opens once, loads each engine once and runs its
    /// replicas, each with its own stream and execution contexts.
    #[arg(long, env = "CELER_DEVICES", default_value = "auto")]
    pub devices: DeviceSelection,

    /// On a GPU with TensorRT, build a missing or unfit engine at start-up (one log line
    /// per model; /ping answers 503 until it is ready) instead of refusing to start.
    /// `celer build` ahead of time is the faster start.
    #[arg(long, env = "CELER_BUILD_ENGINES", default_value_t = false)]
    pub build_engines: bool,

    /// Where engines are (and where --build-engines writes them). Default: the model
    /// folder's engines/, and, when --build-engines cannot write there (SageMaker unpacks
    /// the model archive as root; celer runs as another user), a folder under the
    /// temporary directory for the engines built at start-up.
    #[arg(long, env = "CELER_ENGINES_DIR")]
    pub engines_dir: Option<PathBuf>,
}

impl RuntimeArgs {
    /// `(replicas, threads per replica)`, keeping their product within the cores.
    pub fn replicas_and_threads(&self) -> (usize, usize) {
        self.replicas_and_threads_on(CpuBudget::get().cores)
    }

    /// As `replicas_and_threads`, on `cores` cores.
    pub fn replicas_and_threads_on(&self, cores: usize) -> (usize, usize) {
        match (self.replicas, self.threads_per_replica) {
            (Some(r), Some(t)) => (r.max(1), t.max(1)),
            (Some(r), None) => (r.max(1), (cores / r.max(1)).max(1)),
            (None, Some(t)) => ((cores / t.max(1)).max(1), t.max(1)),
            // Two replicas when there are cores for it: while one replica is in its
            // single-threaded stages (trimap, matting), the other keeps the model busy.
            (None, None) => {
                let r = if cores >= 2 { 2 } else { 1 };
                (r, (cores / r).max(1))
            }
        }
    }

    /// Threads a replica running alone on the CPU gets, when each replica has `own`:
    /// `--solo-threads` (default the cores), never fewer than `own` (then no solo set is
    /// loaded).
    pub fn solo_threads(&self, own: usize) -> usize {
        self.solo_threads.unwrap_or(CpuBudget::get().cores).max(own)
    }

    /// Replicas per GPU, and ONNX Runtime threads for each where TensorRT is absent (the
    /// `gpus` x replicas share the cores).
    pub fn gpu_replicas_and_threads(&self, gpus: usize) -> (usize, usize) {
        let cores = CpuBudget::get().cores;
        let replicas = self.replicas.unwrap_or(2).max(1);
        let threads = self
            .threads_per_replica
            .unwrap_or(cores / (replicas * gpus.max(1)))
            .max(1);
        (replicas, threads)
    }
}

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[command(flatten)]
    pub runtime: RuntimeArgs,

    #[command(flatten)]
    pub device: DeviceArgs,

    #[command(flatten)]
    pub hosting: HostingArgs,

    /// Address to listen on.
    #[arg(long, env = "CELER_BIND", default_value = "0.0.0.0")]
    pub bind: String,

    /// Port to listen on.
    #[arg(long, env = "SAGEMAKER_BIND_TO_PORT", default_value_t = 8080)]
    pub port: u16,

    /// How a request picks its device: least-busy (earliest estimated completion), or
    /// the round-robin and random baselines.
    #[arg(long, env = "CELER_ROUTING", value_enum, default_value_t = Routing::LeastBusy)]
    pub routing: Routing,

    /// Requests that may wait per device, beyond those its replicas run; when every
    /// queue is full the server answers 503 at once.
    #[arg(long, env = "CELER_QUEUE_CAPACITY", default_value_t = 16)]
    pub queue_capacity: usize,

    /// Requests admitted and not yet answered, over every device. Default: each device's
    /// replicas plus its queue capacity, summed.
    #[arg(long, env = "CELER_MAX_IN_FLIGHT")]
    pub max_in_flight: Option<usize>,

    /// Milliseconds a new request may be expected to wait before a replica starts it
    /// (from the devices' measured service times and what is ahead of it); beyond it the
    /// server answers 503 at once, with a `Retry-After` from the same estimate. 0: no
    /// limit by time, only by count. Default: `--max-queue-service-times` service times.
    #[arg(long, env = "CELER_MAX_QUEUE_MS")]
    pub max_queue_ms: Option<u64>,

    /// Without `--max-queue-ms`: the wait budget as this many measured service times (a
    /// full queue is a few service times, whatever the model and device). 0: off.
    #[arg(long, env = "CELER_MAX_QUEUE_SERVICE_TIMES", default_value_t = 2.0)]
    pub max_queue_service_times: f64,

    /// Milliseconds between health checks of an unhealthy device (one that failed repeatedly
    /// or overran a deadline); it gets traffic again once a health check passes.
    #[arg(long, env = "CELER_HEALTH_CHECK_INTERVAL_MS", default_value_t = 1000)]
    pub health_check_interval_ms: u64,

    /// Seconds a request may take from arrival; an expired request is not run. Default:
    /// the hosting mode's (60; async and batch 3600).
    #[arg(long, env = "SAGEMAKER_MODEL_SERVER_TIMEOUT")]
    pub deadline_s: Option<u64>,

    /// Largest request body, bytes. Default: the hosting mode's (realtime 6 MiB,
    /// serverless 4 MiB, batch the job's MaxPayloadInMB, async any image within
    /// --max-pixels).
    #[arg(long, env = "CELER_MAX_BODY_BYTES")]
    pub max_body_bytes: Option<usize>,

    /// Largest image, in pixels (width x height), checked before decoding.
    #[arg(long, env = "CELER_MAX_PIXELS", default_value_t = DecodeLimits::default().max_pixels)]
    pub max_pixels: u64,

    /// Smallest accepted image side, pixels.
    #[arg(long, env = "CELER_MIN_SIDE_PX", default_value_t = DecodeLimits::default().min_side_px)]
    pub min_side_px: u32,

    /// Hosts that JSON bodies may name in `url` for the server to fetch (comma
    /// separated). Empty: fetching is off, and a `url` is refused.
    #[arg(long, env = "CELER_FETCH_ALLOW_HOSTS", value_delimiter = ',')]
    pub fetch_allow_hosts: Vec<String>,

    /// Time limit for fetching a `url`, milliseconds.
    #[arg(long, env = "CELER_FETCH_TIMEOUT_MS", default_value_t = 5000)]
    pub fetch_timeout_ms: u64,

    /// The model's name in the Open Inference Protocol's routes (`/v2/models/{name}/...`);
    /// KServe's InferenceService passes its own name.
    #[arg(long, env = "CELER_MODEL_NAME", default_value = "celer")]
    pub model_name: String,

    /// Send a `Server-Timing` header with the per-stage times of each request.
    #[arg(long, env = "CELER_SERVER_TIMING", default_value_t = false)]
    pub server_timing: bool,

    /// Connection and upload limits (src/config/conn.rs).
    #[command(flatten)]
    pub conn: crate::config::ConnArgs,

    /// Seconds to let in-flight requests finish after SIGTERM (SageMaker kills the
    /// container 30 s after it).
    #[arg(long, env = "CELER_SHUTDOWN_GRACE_S", default_value_t = 25)]
    pub shutdown_grace_s: u64,
}

/// What a request may be, checked before any work is done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestLimits {
    pub max_body_bytes: usize,
    pub decode: DecodeLimits,
    pub deadline: Duration,
}

impl ServeArgs {
    /// The router's configuration under `plan`: a transform job's own concurrency is
    /// admitted at once (queue places for all of it), and in the modes whose requests
    /// wait their turn (batch, async) the wait budget is off unless `--max-queue-ms` set
    /// one.
    pub fn router_config(&self, plan: &HostingPlan) -> RouterConfig {
        let max_queue_wait = match self.max_queue_ms {
            Some(0) => QueueBudget::Off,
            Some(ms) => QueueBudget::Fixed(Duration::from_millis(ms)),
            None if plan.mode.waits_its_turn() => QueueBudget::Off,
            None if self.max_queue_service_times > 0.0 => {
                QueueBudget::ServiceTimes(self.max_queue_service_times)
            }
            None => QueueBudget::Off,
        };
        RouterConfig {
            routing: self.routing,
            queue_capacity: plan.queue_capacity(self.queue_capacity.max(1)),
            max_in_flight: self.max_in_flight,
            max_queue_wait,
            health_check_interval: Duration::from_millis(self.health_check_interval_ms.max(1)),
            ..RouterConfig::default()
        }
    }

    /// The hosting mode's limits with the explicit settings over them, and the transform
    /// job's variables read from the environment (an impossible value is an error).
    pub fn hosting_plan(&self) -> Result<HostingPlan, String> {
        let explicit = Explicit {
            max_body_bytes: self.max_body_bytes,
            max_response_bytes: self.hosting.max_response_bytes,
            deadline_s: self.deadline_s,
            replicas: self.runtime.replicas,
        };
        let job = BatchJob::from_env(|name| std::env::var(name).ok())?;
        Ok(HostingPlan::resolve(
            self.hosting.mode,
            explicit,
            job,
            self.max_pixels,
        ))
    }

    pub fn limits(&self, plan: &HostingPlan) -> RequestLimits {
        RequestLimits {
            max_body_bytes: plan.max_body_bytes,
            decode: DecodeLimits {
                max_pixels: self.max_pixels,
                min_side_px: self.min_side_px,
                max_side_px: DecodeLimits::default().max_side_px,
            },
            deadline: plan.deadline,
        }
    }
}

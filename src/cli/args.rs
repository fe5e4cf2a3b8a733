//! The command line's options, as clap parses them from flags and the environment, and
//! nothing else: `resolve` turns `celer serve`'s into the server's configuration. A
//! range that cannot work (0 replicas, a 0 ms timeout) is refused here, with clap's
//! message, rather than clamped later. SageMaker's own variables are honoured where they
//! mean the same thing: `SAGEMAKER_BIND_TO_PORT`, `SAGEMAKER_MODEL_SERVER_WORKERS`,
//! `SAGEMAKER_MODEL_SERVER_TIMEOUT`, and a transform job's (`config::hosting`).

use std::path::PathBuf;
use std::time::Duration;

use clap::builder::{BoolishValueParser, RangedU64ValueParser};
use clap::Args;

use crate::codec::decode::DecodeLimits;
use crate::config::{ConnLimits, Devices, HostingMode, Replicas};
use crate::sched::{DeviceSelection, QueueBudget, Routing, Scheduling};

/// A count that must be at least 1.
pub(super) fn at_least_one() -> RangedU64ValueParser<usize> {
    RangedU64ValueParser::new().range(1..)
}

/// A time or size that must be above 0.
fn positive_u64() -> RangedU64ValueParser<u64> {
    RangedU64ValueParser::new().range(1..)
}

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
    #[arg(long, env = "SAGEMAKER_MODEL_SERVER_WORKERS", value_parser = at_least_one())]
    pub replicas: Option<usize>,

    /// ONNX Runtime intra-op threads per replica. Default: cores / replicas, the cores
    /// being the container's CPU quota.
    #[arg(long, env = "CELER_THREADS_PER_REPLICA", value_parser = at_least_one())]
    pub threads_per_replica: Option<usize>,

    /// ONNX Runtime threads for a request that runs while no other replica of the CPU
    /// does: one more set of sessions with this many threads is lent to it, so that a
    /// lone request uses every core. Default: the cores (the container's CPU quota); no
    /// more than --threads-per-replica turns it off.
    #[arg(long, env = "CELER_SOLO_THREADS", value_parser = at_least_one())]
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
    /// per model) instead of refusing to start. Meanwhile the CPU serves requests with
    /// ONNX Runtime; they move to each GPU as its engines load, and the CPU's replicas
    /// then unload. /ping answers 503 until every GPU is ready (see
    /// --ready-while-building). `celer build` ahead of time is the faster start.
    #[arg(long, env = "CELER_BUILD_ENGINES", default_value_t = false, value_parser = BoolishValueParser::new())]
    pub build_engines: bool,

    /// With --build-engines: /ping (and v2's ready) answer 200 as soon as the CPU serves,
    /// while the GPUs' engines build, instead of once they have loaded: for a platform
    /// that gives up on a start that is not healthy within its window (SageMaker's
    /// container_startup_health_check_timeout_in_seconds).
    #[arg(long, env = "CELER_READY_WHILE_BUILDING", default_value_t = false, value_parser = BoolishValueParser::new())]
    pub ready_while_building: bool,

    /// Where engines are (and where --build-engines writes them). Default: the model
    /// folder's engines/, and, when --build-engines cannot write there (SageMaker unpacks
    /// the model archive as root; celer runs as another user), a folder under the
    /// temporary directory for the engines built at start-up.
    #[arg(long, env = "CELER_ENGINES_DIR")]
    pub engines_dir: Option<PathBuf>,

    /// An image size, WIDTHxHEIGHT, that each replica runs at load, so that the first
    /// requests of that size pay no first-run costs (on a GPU its resize tables and the
    /// first launches at its grid sizes; on the CPU the first page faults of its memory)
    /// and, on the CPU, are priced from a timed run instead of the prior; repeat it, or
    /// list sizes with commas, for several (the last one's tables stay in place). The
    /// page-locked blocks for requests' pixels are sized for the largest, at least
    /// 1920x1080 (and each GPU replica has blocks for a 12 MP request besides). Every GPU
    /// replica also runs a small image at load.
    #[arg(long = "warmup-size", env = "CELER_WARMUP_SIZES", value_delimiter = ',', value_parser = image_size)]
    pub warmup_sizes: Vec<(u32, u32)>,

    /// Serve the FP32 models even where `celer build --precision` made a variant that
    /// passed its quality gate (by default the CPU serves the INT8 variant and a GPU
    /// builds its engines from the FP16 one).
    #[arg(long, env = "CELER_FP32", default_value_t = false, value_parser = BoolishValueParser::new())]
    pub fp32: bool,
}

/// `WIDTHxHEIGHT`, each side at least 1.
fn image_size(text: &str) -> Result<(u32, u32), String> {
    let (w, h) = text
        .trim()
        .split_once(['x', 'X'])
        .ok_or_else(|| format!("`{text}` is not WIDTHxHEIGHT (such as 1920x1080)"))?;
    let side = |s: &str| match s.trim().parse::<u32>() {
        Ok(v) if v > 0 => Ok(v),
        _ => Err(format!(
            "`{text}`: `{s}` is not a side of at least one pixel"
        )),
    };
    Ok((side(w)?, side(h)?))
}

/// `celer serve`'s options, in groups (each a heading of `--help`).
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    #[command(flatten, next_help_heading = "Model and replicas")]
    pub runtime: RuntimeArgs,

    #[command(flatten, next_help_heading = "Devices")]
    pub device: DeviceArgs,

    #[command(flatten, next_help_heading = "Hosting (SageMaker)")]
    pub hosting: HostingArgs,

    #[command(flatten, next_help_heading = "Listening")]
    pub listen: ListenArgs,

    #[command(flatten, next_help_heading = "Routing and admission")]
    pub admission: AdmissionArgs,

    #[command(flatten, next_help_heading = "Requests")]
    pub requests: RequestArgs,

    #[command(flatten, next_help_heading = "Connections and uploads")]
    pub conn: ConnArgs,
}

/// Where `celer serve` listens, how it names its model, and how it stops.
#[derive(Debug, Clone, Args)]
pub struct ListenArgs {
    /// Address to listen on.
    #[arg(long, env = "CELER_BIND", default_value = "0.0.0.0")]
    pub bind: String,

    /// Port to listen on.
    #[arg(long, env = "SAGEMAKER_BIND_TO_PORT", default_value_t = 8080)]
    pub port: u16,

    /// Port of the Open Inference Protocol over gRPC (`inference.GRPCInferenceService`,
    /// and `grpc.health.v1` for Kubernetes' gRPC probes), as Triton's 8001. 0: no gRPC.
    #[arg(long, env = "CELER_GRPC_PORT", default_value_t = 8001)]
    pub grpc_port: u16,

    /// The model's name in the Open Inference Protocol's routes (`/v2/models/{name}/...`);
    /// KServe's InferenceService passes its own name.
    #[arg(long, env = "CELER_MODEL_NAME", default_value = "celer")]
    pub model_name: String,

    /// Send a `Server-Timing` header with the per-stage times of each request.
    #[arg(long, env = "CELER_SERVER_TIMING", default_value_t = false, value_parser = BoolishValueParser::new())]
    pub server_timing: bool,

    /// Seconds to let in-flight requests finish after SIGTERM (SageMaker kills the
    /// container 30 s after it).
    #[arg(long, env = "CELER_SHUTDOWN_GRACE_S", default_value_t = 25)]
    pub shutdown_grace_s: u64,

    /// Seconds to keep accepting and answering after SIGTERM while readiness (`/ping`,
    /// `/v2/health/ready`) answers 503, before the shutdown grace: the time a load
    /// balancer or Kubernetes takes to stop routing here. 0: stop accepting at once.
    #[arg(long, env = "CELER_DRAIN_S", default_value_t = 0)]
    pub drain_s: u64,
}

/// How requests are placed on devices and when they are refused at once.
#[derive(Debug, Clone, Args)]
pub struct AdmissionArgs {
    /// How a request picks its device: least-busy (earliest estimated completion), or
    /// the least-outstanding, round-robin and random baselines.
    #[arg(long, env = "CELER_ROUTING", value_enum, default_value_t = Routing::LeastBusy)]
    pub routing: Routing,

    /// What routing, admission and each device's queue order price a request by: cost
    /// (each device's cost model, from the image's pixels; queues by priority, then
    /// shortest expected first with aging; a request that cannot finish by its deadline
    /// refused at once), or count (every request the same; queues in arrival order: the
    /// baseline).
    #[arg(long, env = "CELER_SCHEDULING", value_enum, default_value_t = Scheduling::Cost)]
    pub scheduling: Scheduling,

    /// Requests that may wait per device, beyond those its replicas run; when every
    /// queue is full the server answers 503 at once.
    #[arg(long, env = "CELER_QUEUE_CAPACITY", default_value_t = 16, value_parser = at_least_one())]
    pub queue_capacity: usize,

    /// Requests admitted and not yet answered, over every device. Default: each device's
    /// replicas plus its queue capacity, summed.
    #[arg(long, env = "CELER_MAX_IN_FLIGHT", value_parser = at_least_one())]
    pub max_in_flight: Option<usize>,

    /// How long a new request may be expected to wait before a replica starts it (from
    /// the devices' measured service times and what is ahead of it); beyond it the server
    /// answers 503 at once, with a `Retry-After` from the same estimate. A time (`250ms`,
    /// `2s`), a number of measured service times (`2x`: a full queue is a few service
    /// times, whatever the model and device), or `off` (admission by count only).
    /// Default: `2x`; in batch and async hosting `off` (their requests wait their turn).
    #[arg(long, env = "CELER_MAX_QUEUE_WAIT")]
    pub max_queue_wait: Option<QueueBudget>,

    /// Milliseconds between health checks of an unhealthy device (one that failed repeatedly
    /// or overran a deadline); it gets traffic again once a health check passes.
    #[arg(long, env = "CELER_HEALTH_CHECK_INTERVAL_MS", default_value_t = 1000, value_parser = positive_u64())]
    pub health_check_interval_ms: u64,
}

/// What a request may be.
#[derive(Debug, Clone, Args)]
pub struct RequestArgs {
    /// Seconds a request may take from arrival; an expired request is not run. Default:
    /// the hosting mode's (60; async and batch 3600).
    #[arg(long, env = "SAGEMAKER_MODEL_SERVER_TIMEOUT", value_parser = positive_u64())]
    pub deadline_s: Option<u64>,

    /// Largest request body, bytes. Default: the hosting mode's (realtime 6 MiB,
    /// serverless 4 MiB, batch the job's MaxPayloadInMB, async any image within
    /// --max-pixels).
    #[arg(long, env = "CELER_MAX_BODY_BYTES", value_parser = at_least_one())]
    pub max_body_bytes: Option<usize>,

    /// Largest image, in pixels (width x height), checked before decoding.
    #[arg(long, env = "CELER_MAX_PIXELS", default_value_t = DecodeLimits::default().max_pixels, value_parser = positive_u64())]
    pub max_pixels: u64,

    /// Smallest accepted image side, pixels.
    #[arg(long, env = "CELER_MIN_SIDE_PX", default_value_t = DecodeLimits::default().min_side_px)]
    pub min_side_px: u32,

    /// Hosts that JSON bodies may name in `url` for the server to fetch (comma
    /// separated). Empty: fetching is off, and a `url` is refused.
    #[arg(long, env = "CELER_FETCH_ALLOW_HOSTS", value_delimiter = ',')]
    pub fetch_allow_hosts: Vec<String>,

    /// Time limit for fetching a `url`, milliseconds.
    #[arg(long, env = "CELER_FETCH_TIMEOUT_MS", default_value_t = 5000, value_parser = positive_u64())]
    pub fetch_timeout_ms: u64,
}

/// `celer serve`'s hosting options.
#[derive(Debug, Clone, Default, Args)]
pub struct HostingArgs {
    /// SageMaker hosting mode: realtime, async, serverless or batch. It sets the body and
    /// response limits, the deadline and (serverless) the replicas to what the mode
    /// allows. Default: batch when SAGEMAKER_BATCH=true (a transform job), else realtime.
    #[arg(long = "hosting", env = "CELER_HOSTING", value_enum)]
    pub mode: Option<HostingMode>,

    /// Largest response body, bytes, checked before sending: a larger answer is refused
    /// with 413 `response_too_large` saying what to ask for instead. 0: no limit.
    /// Default: the hosting mode's (realtime 6 000 000, serverless 4 000 000, async and
    /// batch none).
    #[arg(long, env = "CELER_MAX_RESPONSE_BYTES")]
    pub max_response_bytes: Option<usize>,
}

/// `celer serve`'s connection and upload limits.
#[derive(Debug, Clone, Args)]
pub struct ConnArgs {
    /// Open connections at once; at the cap the server stops accepting (the kernel's
    /// backlog holds new ones) until one closes.
    #[arg(long, env = "CELER_MAX_CONNECTIONS", default_value_t = 1024, value_parser = at_least_one())]
    pub max_connections: usize,

    /// Milliseconds to receive a whole request head, from the connection's start or from
    /// the head's first byte; then the connection is closed.
    #[arg(long, env = "CELER_HEADER_TIMEOUT_MS", default_value_t = 10_000, value_parser = positive_u64())]
    pub header_timeout_ms: u64,

    /// Milliseconds to receive a whole request body, from its head; then 408
    /// `body_timeout`. No inference slot is held while a body arrives.
    #[arg(long, env = "CELER_BODY_TIMEOUT_MS", default_value_t = 30_000, value_parser = positive_u64())]
    pub body_timeout_ms: u64,

    /// Milliseconds a body may go without a byte arriving; then 408 `body_timeout`.
    #[arg(long, env = "CELER_BODY_IDLE_TIMEOUT_MS", default_value_t = 5_000, value_parser = positive_u64())]
    pub body_idle_timeout_ms: u64,

    /// Milliseconds an idle keep-alive connection is kept open between requests (above
    /// the 60 s idle timeout of AWS load balancers, so that they close first).
    #[arg(long, env = "CELER_KEEP_ALIVE_TIMEOUT_MS", default_value_t = 75_000, value_parser = positive_u64())]
    pub keep_alive_timeout_ms: u64,

    /// Milliseconds a response may wait for the client to read any of it (a client that
    /// stops reading cannot hold the connection); then the connection is closed.
    #[arg(long, env = "CELER_SEND_TIMEOUT_MS", default_value_t = 30_000, value_parser = positive_u64())]
    pub send_timeout_ms: u64,

    /// Bytes of request bodies held in memory at once over every connection; a body that
    /// would go over is refused with 503 `overloaded`.
    #[arg(long, env = "CELER_BODY_BUFFER_BYTES", default_value_t = 256 * 1024 * 1024, value_parser = at_least_one())]
    pub body_buffer_bytes: usize,

    /// After answering before a body was read (413, 415, 503, ...), the server reads and
    /// discards at most this many bytes of it, so that a client that sends its whole
    /// body before reading (Python's http.client, requests) reads the answer instead of
    /// a reset connection.
    #[arg(long, env = "CELER_LINGER_BYTES", default_value_t = 64 * 1024 * 1024)]
    pub linger_bytes: u64,

    /// ... and for at most this many milliseconds.
    #[arg(long, env = "CELER_LINGER_MS", default_value_t = 5_000)]
    pub linger_ms: u64,
}

impl Default for ConnArgs {
    fn default() -> Self {
        ConnLimits::default().into()
    }
}

impl From<ConnLimits> for ConnArgs {
    fn from(l: ConnLimits) -> Self {
        let ms = |d: Duration| d.as_millis() as u64;
        Self {
            max_connections: l.max_connections,
            header_timeout_ms: ms(l.header_timeout),
            body_timeout_ms: ms(l.body_timeout),
            body_idle_timeout_ms: ms(l.body_idle_timeout),
            keep_alive_timeout_ms: ms(l.keep_alive_timeout),
            send_timeout_ms: ms(l.send_timeout),
            body_buffer_bytes: l.body_buffer_bytes,
            linger_bytes: l.linger_bytes,
            linger_ms: ms(l.linger),
        }
    }
}

impl ConnArgs {
    /// The limits as durations, as the HTTP layer applies them.
    pub fn limits(&self) -> ConnLimits {
        let ms = Duration::from_millis;
        ConnLimits {
            max_connections: self.max_connections,
            header_timeout: ms(self.header_timeout_ms),
            body_timeout: ms(self.body_timeout_ms),
            body_idle_timeout: ms(self.body_idle_timeout_ms),
            keep_alive_timeout: ms(self.keep_alive_timeout_ms),
            send_timeout: ms(self.send_timeout_ms),
            body_buffer_bytes: self.body_buffer_bytes,
            linger_bytes: self.linger_bytes,
            linger: ms(self.linger_ms),
        }
    }
}

impl DeviceArgs {
    /// The devices as asked.
    pub fn devices(&self) -> Devices {
        Devices {
            selection: self.devices.clone(),
            build_engines: self.build_engines,
            engines_dir: self.engines_dir.clone(),
            warmup_sizes: self.warmup_sizes.clone(),
            ready_while_building: self.ready_while_building,
            fp32: self.fp32,
        }
    }
}

impl RuntimeArgs {
    /// The replicas and threads as asked.
    pub fn replicas(&self) -> Replicas {
        Replicas {
            replicas: self.replicas,
            threads_per_replica: self.threads_per_replica,
            solo_threads: self.solo_threads,
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Debug, Parser)]
    struct Serve {
        #[command(flatten)]
        args: ServeArgs,
    }

    /// `celer serve`'s options from `flags`, as clap parses them.
    pub(crate) fn parse(flags: &[&str]) -> Result<ServeArgs, clap::Error> {
        Serve::try_parse_from(std::iter::once("serve").chain(flags.iter().copied())).map(|s| s.args)
    }

    /// Booleans from the environment as people write them (`CELER_SERVER_TIMING=1` once
    /// stopped the server at start-up). The only test that sets these variables.
    #[test]
    fn boolean_environment_variables_take_the_usual_spellings() {
        for (value, want) in [
            ("1", true),
            ("yes", true),
            ("on", true),
            ("TRUE", true),
            ("0", false),
            ("no", false),
            ("off", false),
            ("false", false),
        ] {
            std::env::set_var("CELER_SERVER_TIMING", value);
            std::env::set_var("CELER_BUILD_ENGINES", value);
            let parsed = parse(&[]);
            std::env::remove_var("CELER_SERVER_TIMING");
            std::env::remove_var("CELER_BUILD_ENGINES");
            let args = parsed.unwrap_or_else(|e| panic!("{value}: {e}"));
            assert_eq!(
                (args.listen.server_timing, args.device.build_engines),
                (want, want),
                "{value}"
            );
        }
        std::env::set_var("CELER_SERVER_TIMING", "maybe");
        let refused = parse(&[]);
        std::env::remove_var("CELER_SERVER_TIMING");
        assert!(refused.is_err(), "an unknown word is refused");
    }

    #[test]
    fn defaults_round_trip_through_the_flags() {
        assert_eq!(ConnArgs::default().limits(), ConnLimits::default());
    }

    #[test]
    fn ranges_that_cannot_work_are_refused_by_the_command_line() {
        for flag in [
            "--replicas=0",
            "--threads-per-replica=0",
            "--queue-capacity=0",
            "--max-in-flight=0",
            "--health-check-interval-ms=0",
            "--deadline-s=0",
            "--max-connections=0",
            "--header-timeout-ms=0",
            "--max-queue-wait=-1ms",
            "--warmup-size=1920",
            "--warmup-size=0x1080",
            "--warmup-size=axb",
        ] {
            let e = parse(&[flag]).unwrap_err();
            assert_eq!(
                e.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{flag}: {e}"
            );
        }
        let ok = parse(&[
            "--replicas=3",
            "--max-queue-wait=250ms",
            "--warmup-size=1920x1080,640X480",
            "--warmup-size=4032x3024",
        ])
        .unwrap();
        assert_eq!(ok.runtime.replicas, Some(3));
        assert_eq!(
            ok.device.devices().warmup_sizes,
            [(1920, 1080), (640, 480), (4032, 3024)]
        );
        assert_eq!(
            ok.admission.max_queue_wait,
            Some(QueueBudget::Fixed(Duration::from_millis(250)))
        );
    }
}

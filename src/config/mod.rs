//! The configuration of a running server, resolved once at start-up from the command
//! line and the environment (`cli::resolve`), logged once and never changed: the hosting
//! mode's plan, the limits on requests and connections, the router's settings, the
//! replicas and devices asked for. Plain values: this module reads no flag, opens no
//! model and binds no socket.

mod conn;
pub mod hosting;
mod replicas;

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use crate::codec::decode::DecodeLimits;
use crate::sched::{DeviceSelection, SchedulerConfig};

pub use conn::ConnLimits;
pub use hosting::{HostingMode, HostingPlan};
pub use replicas::Replicas;

/// A setting the environment gave that cannot be what the platform sets.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{name}={value}: expected {expected}")]
    Variable {
        name: String,
        value: String,
        expected: String,
    },
    #[error(transparent)]
    Tracing(#[from] crate::trace::TraceConfigError),
}

/// What a request may be, checked before any work is done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestLimits {
    pub max_body_bytes: usize,
    pub decode: DecodeLimits,
    pub deadline: Duration,
}

/// Which devices to start, and what a GPU may do at start-up.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Devices {
    pub selection: DeviceSelection,
    /// Build a missing or unfit engine at start-up instead of refusing to start.
    pub build_engines: bool,
    /// Where engines are (`None`: the model folder's engines/).
    pub engines_dir: Option<PathBuf>,
    /// Image sizes each GPU replica runs once at load, `(width, height)`.
    pub warmup_sizes: Vec<(u32, u32)>,
    /// Readiness says 200 once the CPU serves while the GPUs' engines build, not only
    /// once they have loaded.
    pub ready_while_building: bool,
    /// Serve the FP32 models even where a reduced-precision variant passed its gate.
    pub fp32: bool,
}

/// Fetching images that JSON bodies name by `url`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetch {
    /// Empty: fetching is off.
    pub allow_hosts: Vec<String>,
    pub timeout: Duration,
}

/// Everything `celer serve` runs by, resolved.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    pub model_dir: PathBuf,
    /// The model's name in the Open Inference Protocol's routes.
    pub model_name: String,
    pub bind: String,
    pub port: u16,
    /// The Open Inference Protocol over gRPC; `None`: not served.
    pub grpc_port: Option<u16>,
    pub hosting: HostingPlan,
    pub requests: RequestLimits,
    /// Fitted to the hosting mode's largest body (`ConnLimits::fit_to_bodies`).
    pub connections: ConnLimits,
    pub scheduler: SchedulerConfig,
    pub replicas: Replicas,
    pub devices: Devices,
    pub fetch: Fetch,
    /// Per-stage times in a `Server-Timing` header.
    pub server_timing: bool,
    /// How long celer keeps accepting after SIGTERM, not ready, before it stops.
    pub drain: Duration,
    /// How long in-flight requests may take to finish once celer stops accepting.
    pub shutdown_grace: Duration,
    /// Where spans go (`OTEL_*`); `None`: no tracing.
    pub trace: Option<crate::trace::TraceConfig>,
}

impl fmt::Display for ServerConfig {
    /// The configuration on one line (log collectors split lines into events), for the
    /// start-up log.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let count = |n: Option<usize>| n.map_or("auto".to_string(), |n| n.to_string());
        write!(f, "{}; ", self.hosting.describe())?;
        write!(
            f,
            "model {} ({}), listening on {}:{}{}; ",
            self.model_dir.display(),
            self.model_name,
            self.bind,
            self.port,
            self.grpc_port
                .map_or(String::new(), |p| format!(" and {p} (gRPC)")),
        )?;
        write!(
            f,
            "devices {}, replicas {}, threads per replica {}, engines {}{}; ",
            match &self.devices.selection {
                DeviceSelection::Auto => "auto".to_string(),
                DeviceSelection::Cpu => "cpu".to_string(),
                DeviceSelection::Gpus(ordinals) => ordinals
                    .iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
            },
            count(self.replicas.replicas),
            count(self.replicas.threads_per_replica),
            self.devices
                .engines_dir
                .as_ref()
                .map_or("in the model folder".to_string(), |d| d
                    .display()
                    .to_string()),
            if self.devices.build_engines {
                ", built at start-up when missing"
            } else {
                ""
            }
        )?;
        write!(
            f,
            "routing {} by {}, queue {} per device, in flight {}, queue wait budget {}; ",
            self.scheduler.routing,
            self.scheduler.scheduling,
            self.scheduler.queue_capacity,
            count(self.scheduler.max_in_flight),
            self.scheduler.max_queue_wait
        )?;
        write!(
            f,
            "images up to {} pixels (sides {} to {}), fetching {}; ",
            self.requests.decode.max_pixels,
            self.requests.decode.min_side_px,
            self.requests.decode.max_side_px,
            if self.fetch.allow_hosts.is_empty() {
                "off".to_string()
            } else {
                format!("from {}", self.fetch.allow_hosts.join(", "))
            }
        )?;
        write!(
            f,
            "connections up to {}, bodies in transit up to {} bytes, drain {} s, shutdown grace {} s",
            self.connections.max_connections,
            self.connections.body_buffer_bytes,
            self.drain.as_secs(),
            self.shutdown_grace.as_secs()
        )?;
        match &self.trace {
            Some(t) => write!(f, "; {}", t.describe()),
            None => write!(f, "; no tracing"),
        }
    }
}

//! The scheduler's Prometheus figures by device, named after Triton's (`nv_inference_*`
//! becomes `celer_inference_*`; Triton's own families, per model, are written beside them
//! by `http::metrics::triton`). The families live in the router, not in a global recorder, so a
//! process can hold many routers (tests, `celer sim`); `register` adds them to the
//! registry that `/metrics` encodes. Hot-path handles are resolved once per device.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use std::sync::atomic::AtomicU64;

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeviceLabel {
    pub device: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FailureLabel {
    pub device: String,
    pub reason: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: &'static str,
}

pub(crate) type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

/// Microseconds from 50 us to about 52 s, doubling.
pub(crate) fn latency_us() -> Histogram {
    Histogram::new(exponential_buckets(50.0, 2.0, 21))
}

fn batch_sizes() -> Histogram {
    Histogram::new(exponential_buckets(1.0, 2.0, 8))
}

/// Every family the scheduler records. Cloning shares the same figures.
#[derive(Clone)]
pub struct SchedMetrics {
    pub success: Family<DeviceLabel, Counter>,
    pub failure: Family<FailureLabel, Counter>,
    pub rejected: Family<ReasonLabel, Counter>,
    pub cancelled: Family<DeviceLabel, Counter>,
    pub failover: Family<DeviceLabel, Counter>,
    pub recoveries: Family<DeviceLabel, Counter>,
    pub replacements: Family<DeviceLabel, Counter>,
    pub stuck_runs: Family<DeviceLabel, Counter>,
    pub probes: Family<DeviceLabel, Counter>,
    pub stuck: Family<DeviceLabel, Gauge>,
    pub exec_count: Family<DeviceLabel, Counter>,
    pub request_us: HistogramFamily<DeviceLabel>,
    pub queue_us: HistogramFamily<DeviceLabel>,
    pub compute_us: HistogramFamily<DeviceLabel>,
    pub batch_size: HistogramFamily<DeviceLabel>,
    pub pending: Family<DeviceLabel, Gauge>,
    pub in_flight: Family<DeviceLabel, Gauge>,
    pub healthy: Family<DeviceLabel, Gauge>,
    pub lost: Family<DeviceLabel, Gauge>,
    pub replicas: Family<DeviceLabel, Gauge>,
    pub service_ewma_us: Family<DeviceLabel, Gauge<f64, AtomicU64>>,
}

impl Default for SchedMetrics {
    fn default() -> Self {
        Self {
            success: Family::default(),
            failure: Family::default(),
            rejected: Family::default(),
            cancelled: Family::default(),
            failover: Family::default(),
            recoveries: Family::default(),
            replacements: Family::default(),
            stuck_runs: Family::default(),
            probes: Family::default(),
            stuck: Family::default(),
            exec_count: Family::default(),
            request_us: Family::new_with_constructor(latency_us),
            queue_us: Family::new_with_constructor(latency_us),
            compute_us: Family::new_with_constructor(latency_us),
            batch_size: Family::new_with_constructor(batch_sizes),
            pending: Family::default(),
            in_flight: Family::default(),
            healthy: Family::default(),
            lost: Family::default(),
            replicas: Family::default(),
            service_ewma_us: Family::default(),
        }
    }
}

impl SchedMetrics {
    /// Adds every family to `registry` under the `celer_` prefix.
    pub fn register(&self, registry: &mut Registry) {
        let r = registry.sub_registry_with_prefix("celer");
        r.register(
            "inference_request_success",
            "Requests a device completed",
            self.success.clone(),
        );
        r.register(
            "inference_request_failure",
            "Admitted requests that ended without a result, by device and reason",
            self.failure.clone(),
        );
        r.register(
            "inference_request_rejected",
            "Requests refused at admission (answered 503 at once), by reason",
            self.rejected.clone(),
        );
        r.register(
            "inference_request_cancelled",
            "Queued requests skipped because their client had gone",
            self.cancelled.clone(),
        );
        r.register(
            "inference_failover",
            "Requests moved to another device after this one failed",
            self.failover.clone(),
        );
        r.register(
            "device_recoveries",
            "Times a lost device (a GPU whose context failed) was reopened and reloaded",
            self.recoveries.clone(),
        );
        r.register(
            "replica_replacements",
            "Replicas reloaded with a fresh executor after a panic in one of their runs",
            self.replacements.clone(),
        );
        r.register(
            "replica_stuck_runs",
            "Runs that went on past their request's deadline (the replica is routed around)",
            self.stuck_runs.clone(),
        );
        r.register(
            "device_price_probes",
            "Requests sent to a device although its prices refused them, after it had run nothing for a while, to measure them again",
            self.probes.clone(),
        );
        r.register(
            "replicas_stuck",
            "Replicas running past their request's deadline now",
            self.stuck.clone(),
        );
        r.register(
            "inference_exec_count",
            "Model runs (batches) a device executed",
            self.exec_count.clone(),
        );
        r.register(
            "inference_request_duration_us",
            "Time from admission to result, microseconds",
            self.request_us.clone(),
        );
        r.register(
            "inference_queue_duration_us",
            "Time a request waited in its device's queue, microseconds",
            self.queue_us.clone(),
        );
        r.register(
            "inference_compute_infer_duration_us",
            "Wall time of one model run (a batch), microseconds",
            self.compute_us.clone(),
        );
        r.register(
            "inference_batch_size",
            "Requests per model run",
            self.batch_size.clone(),
        );
        r.register(
            "inference_pending_request_count",
            "Requests waiting in a device's queue",
            self.pending.clone(),
        );
        r.register(
            "inference_exec_in_flight",
            "Requests a device's replicas are running",
            self.in_flight.clone(),
        );
        r.register(
            "device_healthy",
            "1 while a device takes traffic, 0 while it waits for a health check to pass",
            self.healthy.clone(),
        );
        r.register(
            "device_lost",
            "1 once a device is lost for good (it cannot come back in this process: the server restarts)",
            self.lost.clone(),
        );
        r.register(
            "device_replicas",
            "Replicas a device runs",
            self.replicas.clone(),
        );
        r.register(
            "device_service_time_ewma_us",
            "Moving average of a device's service time per request, microseconds",
            self.service_ewma_us.clone(),
        );
    }

    pub(crate) fn for_device(&self, name: &str) -> DeviceMetrics {
        let label = DeviceLabel {
            device: name.to_string(),
        };
        DeviceMetrics {
            success: self.success.get_or_create_owned(&label),
            cancelled: self.cancelled.get_or_create_owned(&label),
            failover: self.failover.get_or_create_owned(&label),
            recoveries: self.recoveries.get_or_create_owned(&label),
            replacements: self.replacements.get_or_create_owned(&label),
            stuck_runs: self.stuck_runs.get_or_create_owned(&label),
            probes: self.probes.get_or_create_owned(&label),
            stuck: self.stuck.get_or_create_owned(&label),
            exec_count: self.exec_count.get_or_create_owned(&label),
            request_us: self.request_us.get_or_create_owned(&label),
            queue_us: self.queue_us.get_or_create_owned(&label),
            compute_us: self.compute_us.get_or_create_owned(&label),
            batch_size: self.batch_size.get_or_create_owned(&label),
            pending: self.pending.get_or_create_owned(&label),
            in_flight: self.in_flight.get_or_create_owned(&label),
            healthy: self.healthy.get_or_create_owned(&label),
            lost: self.lost.get_or_create_owned(&label),
            replicas: self.replicas.get_or_create_owned(&label),
            service_ewma_us: self.service_ewma_us.get_or_create_owned(&label),
            failure: self.failure.clone(),
            name: name.to_string(),
        }
    }
}

/// One device's handles, so recording never looks a label set up.
#[derive(Clone)]
pub(crate) struct DeviceMetrics {
    pub success: Counter,
    pub cancelled: Counter,
    pub failover: Counter,
    pub recoveries: Counter,
    pub replacements: Counter,
    pub stuck_runs: Counter,
    pub probes: Counter,
    pub stuck: Gauge,
    pub exec_count: Counter,
    pub request_us: Histogram,
    pub queue_us: Histogram,
    pub compute_us: Histogram,
    pub batch_size: Histogram,
    pub pending: Gauge,
    pub in_flight: Gauge,
    pub healthy: Gauge,
    /// 1 once the device is lost for good (`DeviceState::mark_lost_for_good`).
    pub lost: Gauge,
    pub replicas: Gauge,
    pub service_ewma_us: Gauge<f64, AtomicU64>,
    failure: Family<FailureLabel, Counter>,
    name: String,
}

impl DeviceMetrics {
    pub fn failure(&self, reason: &'static str) {
        self.failure
            .get_or_create(&FailureLabel {
                device: self.name.clone(),
                reason,
            })
            .inc();
    }
}

pub(crate) fn us(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

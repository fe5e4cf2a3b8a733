//! The live figures of one device, shared by the router (placement), its replica threads
//! (which update them) and the watchdog (health). Only atomics on the request path; the
//! health flag is mirrored in a watch channel so waiting requests learn of a failure.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::watch;

use super::cost::CostModel;
use super::metrics::DeviceMetrics;

/// Weight of the newest observation in the moving average of service time. 0.1 follows a
/// change of speed within a few tens of requests and smooths single slow ones.
pub(crate) const EWMA_WEIGHT: f64 = 0.1;

pub(crate) struct DeviceState {
    pub index: usize,
    pub name: String,
    pub replicas: usize,
    /// Requests queued or running: incremented before a request is queued, decremented
    /// when it is dropped, whoever drops it (see `Outstanding`).
    pub outstanding: AtomicUsize,
    pub running: AtomicUsize,
    /// Replicas whose run went past its deadline and has not ended: routed around (the
    /// throughput estimate leaves them out; the device turns unhealthy when all are).
    pub stuck: AtomicUsize,
    /// A stuck run loses the device for good (`Executor::stuck_is_lost`).
    pub stuck_is_lost: AtomicBool,
    /// Seconds per request, as f64 bits; 0 until the first observation.
    service_s: AtomicU64,
    /// Seconds per request by size: what routing, admission and the queue's order price
    /// a request at.
    pub cost: CostModel,
    healthy: AtomicBool,
    health: watch::Sender<bool>,
    consecutive_failures: AtomicU32,
    pub health_check_pending: AtomicBool,
    pub last_health_check_ns: AtomicU64,
    /// Per replica: the deadline of the batch it runs (ns since `epoch`), 0 when idle.
    pub running_deadline_ns: Vec<AtomicU64>,
    /// Per replica: when its batch started (ns since `epoch`) and the batch's predicted
    /// cost (ns), 0 when idle: what is left of the runs, for the expected wait.
    pub running_started_ns: Vec<AtomicU64>,
    pub running_cost_ns: Vec<AtomicU64>,
    /// Replicas running a batch that holds a job priced by the prior (`Job::measured`
    /// false): what is left of the runs is then a guess.
    pub running_guesses: AtomicUsize,
    /// When the newest successful run ended (ns since `epoch`), 0 before the first.
    pub last_run_ns: AtomicU64,
    /// When the newest probe was sent (ns since `epoch`; `Shared::may_probe` in the scheduler).
    pub last_probe_ns: AtomicU64,
    pub loaded: AtomicUsize,
    /// Serves only until every other device has loaded (`DeviceSetup::interim`).
    pub interim: bool,
    /// An interim device that has stopped taking requests.
    pub retired: AtomicBool,
    pub load_error: Mutex<Option<String>>,
    /// Why the device is out of service for good (`Recovery::NeedsRestart`): it is never
    /// checked or sent anything again, and the server restarts the process.
    lost_for_good: Mutex<Option<String>>,
    pub metrics: DeviceMetrics,
    pub epoch: Instant,
}

impl DeviceState {
    pub fn new(
        index: usize,
        name: String,
        replicas: usize,
        interim: bool,
        metrics: DeviceMetrics,
        epoch: Instant,
    ) -> Self {
        metrics.replicas.set(replicas as i64);
        Self {
            index,
            name,
            replicas,
            outstanding: AtomicUsize::new(0),
            running: AtomicUsize::new(0),
            stuck: AtomicUsize::new(0),
            stuck_is_lost: AtomicBool::new(false),
            service_s: AtomicU64::new(0),
            cost: CostModel::default(),
            healthy: AtomicBool::new(true),
            health: watch::channel(true).0,
            consecutive_failures: AtomicU32::new(0),
            health_check_pending: AtomicBool::new(false),
            last_health_check_ns: AtomicU64::new(0),
            running_deadline_ns: (0..replicas).map(|_| AtomicU64::new(0)).collect(),
            running_started_ns: (0..replicas).map(|_| AtomicU64::new(0)).collect(),
            running_cost_ns: (0..replicas).map(|_| AtomicU64::new(0)).collect(),
            running_guesses: AtomicUsize::new(0),
            last_run_ns: AtomicU64::new(0),
            last_probe_ns: AtomicU64::new(0),
            loaded: AtomicUsize::new(0),
            interim,
            retired: AtomicBool::new(false),
            load_error: Mutex::new(None),
            lost_for_good: Mutex::new(None),
            metrics,
            epoch,
        }
    }

    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    /// Whether new requests may go to it: healthy, and not a retired interim device.
    pub fn is_routable(&self) -> bool {
        self.is_healthy() && !self.retired.load(Ordering::Acquire)
    }

    /// Whether a replica has loaded its models (and so can run what is queued).
    pub fn has_loaded(&self) -> bool {
        self.loaded.load(Ordering::Acquire) > 0
    }

    /// Whether every replica has loaded.
    pub fn all_loaded(&self) -> bool {
        self.loaded.load(Ordering::Acquire) >= self.replicas
    }

    /// Receives `false` when the device is marked unhealthy.
    pub fn watch_health(&self) -> watch::Receiver<bool> {
        self.health.subscribe()
    }

    pub fn mark_unhealthy(&self, why: &str) {
        if self.healthy.swap(false, Ordering::AcqRel) {
            tracing::warn!(device = %self.name, reason = why, "device marked unhealthy: no traffic until a health check passes");
            self.health.send_replace(false);
        }
    }

    /// The device cannot come back in this process (`why`): out of routing for good, no
    /// health check again. True the first time (the caller reports it), false after.
    pub fn mark_lost_for_good(&self, why: &str) -> bool {
        let first = {
            let mut lost = self.lost_for_good.lock().unwrap_or_else(|p| p.into_inner());
            let first = lost.is_none();
            lost.get_or_insert_with(|| why.to_string());
            first
        };
        self.metrics.lost.set(1);
        self.mark_unhealthy("the device is lost and cannot come back in this process");
        first
    }

    /// Why the device is out of service for good, if it is.
    pub fn lost_for_good(&self) -> Option<String> {
        self.lost_for_good
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn mark_healthy(&self) {
        if self.lost_for_good().is_some() {
            return;
        }
        self.consecutive_failures.store(0, Ordering::Release);
        if !self.healthy.swap(true, Ordering::AcqRel) {
            tracing::info!(device = %self.name, "health check passed: device healthy again");
            self.health.send_replace(true);
        }
    }

    /// A run that failed; `threshold` in a row make the device unhealthy.
    pub fn record_failure(&self, threshold: u32) {
        let n = self.consecutive_failures.fetch_add(1, Ordering::AcqRel) + 1;
        if n >= threshold.max(1) {
            self.mark_unhealthy("the backend failed repeatedly");
        }
    }

    /// A run that succeeded in `per_request` per request.
    /// A success whose time says nothing of the work's price (a run that stalled).
    pub fn record_success_untimed(&self) {
        self.consecutive_failures.store(0, Ordering::Release);
    }

    pub fn record_success(&self, per_request: Duration) {
        self.record_success_untimed();
        let x = per_request.as_secs_f64();
        // Replicas update concurrently: a CAS loop keeps every observation.
        let _ = self
            .service_s
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |bits| {
                let old = f64::from_bits(bits);
                let new = if old > 0.0 {
                    old + EWMA_WEIGHT * (x - old)
                } else {
                    x
                };
                Some(new.to_bits())
            });
    }

    /// A run (a request's, or a warm-up's) ended now: its prices were just tested
    /// (`last_run_ns`, which probes are timed from).
    pub fn note_run_ended(&self) {
        self.last_run_ns
            .store(self.now_ns().max(1), Ordering::Release);
    }

    /// The moving average of service time per request, if any has been measured.
    pub fn service_s(&self) -> Option<f64> {
        let s = f64::from_bits(self.service_s.load(Ordering::Acquire));
        (s > 0.0).then_some(s)
    }

    pub fn seed_service_time(&self, per_request: Duration) {
        self.service_s
            .store(per_request.as_secs_f64().to_bits(), Ordering::Release);
        self.cost.seed(per_request);
    }

    /// What is left of the runs going on now, as priced when they started (a run past its
    /// price has nothing left), summed over the replicas.
    pub fn running_left(&self) -> Duration {
        let now = self.now_ns();
        let left: u64 = self
            .running_started_ns
            .iter()
            .zip(&self.running_cost_ns)
            .map(|(started, cost)| {
                let started = started.load(Ordering::Acquire);
                if started == 0 {
                    return 0;
                }
                let cost = cost.load(Ordering::Acquire);
                cost.saturating_sub(now.saturating_sub(started))
            })
            .sum();
        Duration::from_nanos(left)
    }

    /// Replica `replica` holds work priced at `cost` since `since`: what is left of its
    /// run, and when admission's plan has it free. Claimed as the replica takes a job off
    /// the queue, under the queue's lock, so that a plan of the device (its queue, then
    /// its replicas) never finds the job in neither; and again as the run starts. Between
    /// the take and the start there are a few instructions, but on a loaded machine a time
    /// slice or more: a replica read as free then let admission plan a new request to
    /// start at once, and it started a whole run later.
    pub fn claim(&self, replica: usize, cost: Duration, since: Instant) {
        self.running_cost_ns[replica].store(cost.as_nanos() as u64, Ordering::Release);
        self.running_started_ns[replica].store(self.instant_ns(since), Ordering::Release);
    }

    /// The replica holds nothing: its run ended, or it let go of what it took without
    /// running it (its client left, its deadline passed, the device went unhealthy).
    pub fn unclaim(&self, replica: usize) {
        self.running_started_ns[replica].store(0, Ordering::Release);
    }

    pub fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    pub fn instant_ns(&self, at: Instant) -> u64 {
        // Never 0, which means "idle".
        (at.saturating_duration_since(self.epoch).as_nanos() as u64).max(1)
    }
}

/// One request counted in `outstanding` for as long as it exists: dropping it (run,
/// skipped, drained or refused by a full queue) gives the count back, so the estimate can
/// never drift.
pub(crate) struct Outstanding(Arc<DeviceState>);

impl Outstanding {
    pub fn new(state: &Arc<DeviceState>) -> Self {
        state.outstanding.fetch_add(1, Ordering::AcqRel);
        Self(state.clone())
    }
}

impl Drop for Outstanding {
    fn drop(&mut self) {
        self.0.outstanding.fetch_sub(1, Ordering::AcqRel);
    }
}

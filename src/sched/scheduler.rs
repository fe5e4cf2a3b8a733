//! The scheduler: one bounded queue per device, placement of each request (least busy by
//! estimated completion, or the least-outstanding, round-robin and random baselines),
//! admission (queue bounds, a global in-flight limit, the expected wait against its
//! budget and the request's deadline, refused at once), device health with a watchdog
//! and health checks, and one fail-over per request. It never runs a model itself.
//!
//! Work is priced by each device's cost model (`Scheduling::Cost`, the default): a
//! request's expected completion is what is left of the runs, the queued work that would
//! run before it, and its own price. `Scheduling::Count` is the estimate by request count
//! and the arrival order that came before, kept as the baseline to measure against.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio::sync::{oneshot, watch};

use super::choice::{by_completion, first_admitted};
use super::cost::{Prices, Work};
use super::executor::LoadFn;
use super::job::Job;
use super::metrics::{us, ReasonLabel, SchedMetrics};
use super::queue::{fit, DeviceQueue, Entry, Fit, Order, PushError};
use super::state::{DeviceState, Outstanding};
use super::terms::Terms;
use super::worker::{self, ReplicaConfig};
use super::{Done, Executor, JobError, LoadFailed, Readiness, SubmitError};
use crate::spec::BatchingSpec;

/// How a request picks its device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Routing {
    /// The device with the earliest estimated completion.
    #[default]
    LeastBusy,
    /// The device with the fewest requests queued or running (baseline: SageMaker's
    /// least-outstanding-requests router over one copy per device).
    LeastOutstanding,
    /// Each device in turn (baseline).
    RoundRobin,
    /// A uniformly random device per request (baseline).
    Random,
}

impl fmt::Display for Routing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::LeastBusy => "least-busy",
            Self::LeastOutstanding => "least-outstanding",
            Self::RoundRobin => "round-robin",
            Self::Random => "random",
        })
    }
}

/// One device to start.
pub struct DeviceSetup<E> {
    pub name: String,
    pub replicas: usize,
    pub batching: BatchingSpec,
    pub load: LoadFn<E>,
    /// Serves only until every other device has loaded: the CPU while the GPUs' engines
    /// build. Requests go to it (and only to loaded devices) meanwhile; once the others
    /// have loaded it takes no new request, finishes those it holds, and its replicas
    /// end, giving back their memory.
    pub interim: bool,
}

/// How the scheduler prices a request: what routing, admission and a device's queue
/// order go by.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Scheduling {
    /// By work: each device's cost model prices the request from its size; queues run
    /// by priority, then shortest expected first with aging, deadlines kept; a request
    /// that cannot finish by its deadline is refused at once.
    #[default]
    Cost,
    /// By count: every request costs the device's mean service time; queues run in
    /// arrival order (the estimate before the cost model, kept as a baseline).
    Count,
}

impl fmt::Display for Scheduling {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Cost => "cost",
            Self::Count => "count",
        })
    }
}

/// The default `SchedulerConfig::reprobe_after`. Prices only change with runs, so a
/// device whose prices refuse every request would refuse them for good: a cold start
/// whose first runs paid for the process's first page faults priced U2NetP's model stage
/// at 1.55 s where it takes 0.1, and a server with a 1.5 s deadline refused everything
/// from then on. A probe after 10 s without a run bounds that to 10 s; where the prices
/// were right, it costs one request that misses its deadline each 10 s the device
/// refuses everything.
pub const REPROBE_AFTER: Duration = Duration::from_secs(10);

#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub routing: Routing,
    pub scheduling: Scheduling,
    /// Requests that may wait per device, besides those its replicas run.
    pub queue_capacity: usize,
    /// Admitted requests not yet answered, over every device. `None`: each device's
    /// replicas plus queue, summed.
    pub max_in_flight: Option<usize>,
    /// The longest a new request may be expected to wait before a replica starts it
    /// (`Scheduler::estimated_wait`); beyond it admission refuses.
    pub max_queue_wait: QueueBudget,
    /// Failed runs in a row that make a device unhealthy.
    pub unhealthy_after_failures: u32,
    /// How often an unhealthy device is checked.
    pub health_check_interval: Duration,
    /// How long a device whose prices refuse work may go without a run before a request
    /// they refuse is sent to it anyway, to measure them again (`Shared::may_probe`).
    pub reprobe_after: Duration,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        Self {
            routing: Routing::LeastBusy,
            scheduling: Scheduling::Cost,
            queue_capacity: 16,
            max_in_flight: None,
            max_queue_wait: QueueBudget::Off,
            unhealthy_after_failures: 3,
            health_check_interval: Duration::from_secs(1),
            reprobe_after: REPROBE_AFTER,
        }
    }
}

/// How long a new request may be expected to wait for a replica before admission
/// refuses it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum QueueBudget {
    /// By count only (queue capacity, in-flight limit).
    Off,
    /// A fixed time.
    Fixed(Duration),
    /// This many service times, as measured: the budget follows the model and the
    /// device (a CPU's second is a GPU's few milliseconds).
    ServiceTimes(f64),
}

impl fmt::Display for QueueBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Off => f.write_str("off"),
            Self::Fixed(d) => write!(f, "{}ms", d.as_millis()),
            Self::ServiceTimes(k) => write!(f, "{k}x"),
        }
    }
}

/// A queue budget that is not `off`, a time (`250ms`, `2s`) or service times (`2x`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{0}`: expected `off`, a time such as `250ms` or `2s`, or service times such as `2x`")]
pub struct QueueBudgetError(String);

impl std::str::FromStr for QueueBudget {
    type Err = QueueBudgetError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let word = text.trim().to_ascii_lowercase();
        let wrong = || QueueBudgetError(text.to_string());
        let positive = |n: &str| {
            n.trim()
                .parse::<f64>()
                .ok()
                .filter(|v| v.is_finite() && *v > 0.0)
                .ok_or_else(wrong)
        };
        if word == "off" {
            Ok(Self::Off)
        } else if let Some(k) = word.strip_suffix('x') {
            Ok(Self::ServiceTimes(positive(k)?))
        } else if let Some(ms) = word.strip_suffix("ms") {
            Ok(Self::Fixed(Duration::from_secs_f64(positive(ms)? / 1e3)))
        } else if let Some(s) = word.strip_suffix('s') {
            Ok(Self::Fixed(Duration::from_secs_f64(positive(s)?)))
        } else {
            Err(wrong())
        }
    }
}

/// The expected time until a new request on a device finishes, in units of
/// `service_s`: it waits for the requests ahead of it beyond the free replicas, shared
/// out over the replicas, then runs. That is (queued + in flight) / replicas x service
/// time, counting the new request itself, so an idle fast device beats an idle slow one.
pub fn estimated_completion(outstanding: usize, replicas: usize, service_s: f64) -> f64 {
    let replicas = replicas.max(1);
    let ahead = (outstanding + 1).saturating_sub(replicas);
    service_s * (1.0 + ahead as f64 / replicas as f64)
}

/// A device as the router sees it now.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceView {
    pub name: String,
    pub replicas: usize,
    /// Takes requests: healthy, and not an interim device that has retired.
    pub healthy: bool,
    /// Queued plus running.
    pub outstanding: usize,
    pub queued: usize,
    pub running: usize,
    /// Moving average of service time per request; `None` before the first.
    pub service_s: Option<f64>,
    /// The cost model's prices; `None` before the first run.
    pub prices: Option<Prices>,
    /// The margin deadlines are kept with: the slowest recent run against its price.
    pub overrun: f64,
    /// The expected wait before one of its replicas starts a request placed on it now;
    /// `None` before a service time is measured.
    pub expected_wait_s: Option<f64>,
}

pub struct Scheduler<E: Executor> {
    shared: Arc<Shared<E>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

struct Shared<E: Executor> {
    devices: Vec<DeviceSlot<E>>,
    routing: Routing,
    scheduling: Scheduling,
    queue_capacity: usize,
    max_in_flight: usize,
    max_queue_wait: QueueBudget,
    /// Shared with each `Admission`, which holds a slot before it becomes a ticket.
    in_flight: Arc<AtomicUsize>,
    /// Requests admitted since the start.
    admitted: AtomicU64,
    /// Round robin's turn, and least busy's starting point (so ties rotate).
    cursor: AtomicUsize,
    /// Held from a request's placement to its push: each placement plans the queue it
    /// joins (`queue::fit`), and two planned at once on the same queue each saw it
    /// without the other.
    placing: Mutex<()>,
    stopped: AtomicBool,
    health_check_interval: Duration,
    reprobe_after: Duration,
    metrics: SchedMetrics,
}

struct DeviceSlot<E: Executor> {
    state: Arc<DeviceState>,
    /// Shared with the device's replicas; closed when the router goes.
    queue: Arc<DeviceQueue<E>>,
    /// Its replicas run one job at a time (no batching): what admission's plan of its
    /// queue assumes (`queue::plan`). A batching device is admitted on the shared wait.
    one_at_a_time: bool,
}

impl<E: Executor> Drop for DeviceSlot<E> {
    fn drop(&mut self) {
        self.queue.close();
    }
}

impl<E: Executor> DeviceSlot<E> {
    /// Every replica busy and every queue place taken: the requests placed here and not
    /// finished (queued or running) reach the replicas plus the queue capacity. Counted,
    /// not read off the channel, whose length also holds the jobs idle replicas are
    /// about to take.
    fn full(&self, queue_capacity: usize) -> bool {
        self.state.outstanding.load(Ordering::Acquire) >= self.state.replicas + queue_capacity
    }
}

impl<E: Executor> Scheduler<E> {
    /// Starts every device's replicas (each loads on its own thread; see `readiness`)
    /// and the health watchdog. Returns at once.
    pub fn start(devices: Vec<DeviceSetup<E>>, config: SchedulerConfig) -> Self {
        let epoch = Instant::now();
        let metrics = SchedMetrics::default();
        let queue_capacity = config.queue_capacity.max(1);
        let mut threads = Vec::new();
        let mut slots = Vec::new();
        for (index, setup) in devices.into_iter().enumerate() {
            let replicas = setup.replicas.max(1);
            let state = Arc::new(DeviceState::new(
                index,
                setup.name.clone(),
                replicas,
                setup.interim,
                metrics.for_device(&setup.name),
                epoch,
            ));
            // Room for the replicas' next jobs too: a job sent to an idle replica sits in
            // the queue until its thread wakes, and must not take a queue place meanwhile
            // (a device is full by its outstanding count, `DeviceSlot::full`).
            let order = match config.scheduling {
                Scheduling::Cost => Order::Cost,
                Scheduling::Count => Order::Fifo,
            };
            let queue = Arc::new(DeviceQueue::new(order, queue_capacity + replicas));
            for replica in 0..replicas {
                let config = ReplicaConfig {
                    index: replica,
                    load: setup.load.clone(),
                    batching: setup.batching,
                    unhealthy_after_failures: config.unhealthy_after_failures,
                };
                match worker::spawn(state.clone(), config, queue.clone()) {
                    Ok(thread) => threads.push(thread),
                    Err(e) => {
                        let mut slot = state.load_error.lock().unwrap_or_else(|p| p.into_inner());
                        slot.get_or_insert(format!("cannot start a replica thread: {e}"));
                    }
                }
            }
            slots.push(DeviceSlot {
                state,
                queue,
                one_at_a_time: setup.batching.max_batch <= 1,
            });
        }
        let max_in_flight = config.max_in_flight.unwrap_or_else(|| {
            slots
                .iter()
                .map(|s| s.state.replicas + queue_capacity)
                .sum()
        });
        let shared = Arc::new(Shared {
            devices: slots,
            routing: config.routing,
            scheduling: config.scheduling,
            queue_capacity,
            max_in_flight: max_in_flight.max(1),
            max_queue_wait: config.max_queue_wait,
            in_flight: Arc::new(AtomicUsize::new(0)),
            admitted: AtomicU64::new(0),
            cursor: AtomicUsize::new(0),
            placing: Mutex::new(()),
            stopped: AtomicBool::new(false),
            health_check_interval: config.health_check_interval,
            reprobe_after: config.reprobe_after,
            metrics,
        });
        let tick = (config.health_check_interval / 4)
            .clamp(Duration::from_millis(1), Duration::from_millis(50));
        let weak = Arc::downgrade(&shared);
        match std::thread::Builder::new()
            .name("celer-watchdog".into())
            .spawn(move || watchdog(weak, tick))
        {
            Ok(thread) => threads.push(thread),
            Err(e) => {
                tracing::error!(error = %e, "cannot start the health watchdog: failed devices will not be checked")
            }
        }
        Self {
            shared,
            threads: Mutex::new(threads),
        }
    }

    /// Admits `input`, a request of no particular size at the default priority, and
    /// queues it on a device, or refuses at once: `Overloaded` when the in-flight limit
    /// or the chosen queue is full, `NoHealthyDevice`, `Stopped`.
    pub fn submit(&self, input: E::Input, deadline: Instant) -> Result<Ticket<E>, SubmitError> {
        self.submit_admitted(self.admit()?, input, Terms::by(deadline))
    }

    /// Queues `input` on a device with the slot `admission` holds, or refuses at once
    /// (`Overloaded` when the chosen queue is full, `DeadlineUnreachable` when no device
    /// it is offered to would finish it by `terms.deadline`, `NoHealthyDevice`,
    /// `Stopped`), giving the slot back.
    pub fn submit_admitted(
        &self,
        mut admission: Admission,
        input: E::Input,
        terms: Terms,
    ) -> Result<Ticket<E>, SubmitError> {
        // A refusal drops `admission`, which gives the slot back.
        let placed = self.shared.enqueue(input.clone(), &terms, None)?;
        // From here the ticket owns the in-flight slot; dropping it gives the slot back.
        admission.holds_slot = false;
        Ok(Ticket {
            shared: self.shared.clone(),
            input,
            terms,
            admitted: admission.admitted,
            placed,
            failed_over: false,
        })
    }

    /// Takes an in-flight slot before any work is done for a request (decoding it), or
    /// refuses at once: `Overloaded` when every slot is taken, `WaitTooLong` when the
    /// request would be expected to wait longer than `max_queue_wait` before a replica
    /// starts it. An overloaded server then costs a refused request nothing, memory stays
    /// bounded by the slots, not by the arrivals, and admitted requests wait at most about
    /// the budget.
    pub fn admit(&self) -> Result<Admission, SubmitError> {
        let shared = &self.shared;
        if shared.stopped.load(Ordering::Acquire) {
            return Err(SubmitError::Stopped);
        }
        let ahead = shared.in_flight.fetch_add(1, Ordering::AcqRel);
        let refusal = if ahead >= shared.max_in_flight {
            // The time until enough of those ahead finish to free one slot.
            let to_free = ahead + 1 - shared.max_in_flight;
            Some(SubmitError::Overloaded {
                capacity: shared.max_in_flight,
                retry_after_ms: shared.time_to_finish(to_free).map_or(1000, ms),
            })
        } else {
            match (shared.queue_budget(), shared.expected_wait(ahead)) {
                (Some(budget), Some(wait)) if wait > budget => Some(SubmitError::WaitTooLong {
                    estimated_ms: ms(wait),
                    budget_ms: ms(budget),
                    retry_after_ms: ms(wait - budget),
                }),
                _ => None,
            }
        };
        if let Some(e) = refusal {
            shared.in_flight.fetch_sub(1, Ordering::AcqRel);
            shared.count_rejection(&e);
            return Err(e);
        }
        shared.admitted.fetch_add(1, Ordering::Relaxed);
        Ok(Admission {
            in_flight: shared.in_flight.clone(),
            admitted: Instant::now(),
            holds_slot: true,
        })
    }

    /// What `admit` would answer now, without holding a slot: the check made before a
    /// request's body is read, so that an overloaded server refuses before reading it.
    pub fn check_admission(&self) -> Result<(), SubmitError> {
        self.admit().map(drop)
    }

    /// Refuses at once (`DeadlineUnreachable`) a request that no device would finish by
    /// `terms.deadline`, before any work is done for it: a request whose size is known from its header is priced before it is decoded,
    /// so that a refusal costs no decode. Scheduling by cost only; anything else is
    /// left to `submit_admitted`, which places the request.
    pub fn check_deadline(&self, terms: &Terms) -> Result<(), SubmitError> {
        if self.shared.scheduling != Scheduling::Cost {
            return Ok(());
        }
        // A probe is only claimed by the placement itself: claimed here, the request would
        // be refused there, and the device would wait another `reprobe_after` for a run.
        match self.shared.place(None, terms, Probe::Peek) {
            Err(e @ SubmitError::DeadlineUnreachable { .. }) => {
                self.shared.count_rejection(&e);
                Err(e)
            }
            _ => Ok(()),
        }
    }

    /// The expected wait before a replica starts a request admitted now (see
    /// `Shared::expected_wait`). `None` until a service time has been measured.
    pub fn estimated_wait(&self) -> Option<Duration> {
        self.shared
            .expected_wait(self.shared.in_flight.load(Ordering::Acquire))
    }

    /// The device the routing policy would give a request of `work` now, without
    /// admitting one: the router's decision alone (round robin advances its turn).
    pub fn choose(&self, work: Work) -> Result<usize, SubmitError> {
        let terms = Terms::by(Instant::now() + Duration::from_secs(3600)).with_work(work);
        self.shared
            .place(None, &terms, Probe::Peek)
            .map(|p| p.device)
    }

    /// Whether the devices have loaded: `Ready` once every replica of the devices that
    /// stay has (an interim device is not waited for), `Interim` while an interim device
    /// serves and the others load, `Failed` after any failed load. The counts are of the
    /// replicas of the devices that stay.
    pub fn readiness(&self) -> Readiness {
        let devices = &self.shared.devices;
        // With no device to stay, an interim one is waited for like any.
        let none_lasting = devices.iter().all(|d| d.state.interim);
        let (mut loaded, mut of, mut interim_serves) = (0, 0, false);
        for slot in devices {
            let state = &slot.state;
            if let Some(e) = state
                .load_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
            {
                return Readiness::Failed(format!("{}: {e}", state.name));
            }
            if !state.interim || none_lasting {
                loaded += state.loaded.load(Ordering::Acquire).min(state.replicas);
                of += state.replicas;
            } else if state.has_loaded() && state.is_routable() {
                interim_serves = true;
            }
        }
        if loaded >= of {
            Readiness::Ready
        } else if interim_serves {
            Readiness::Interim { loaded, of }
        } else {
            Readiness::Loading { loaded, of }
        }
    }

    /// Waits (blocking) until every replica has loaded or one has failed.
    pub fn wait_ready(&self) -> Result<(), LoadFailed> {
        loop {
            match self.readiness() {
                Readiness::Ready => return Ok(()),
                Readiness::Failed(e) => return Err(LoadFailed(e)),
                Readiness::Loading { .. } | Readiness::Interim { .. } => {
                    std::thread::sleep(Duration::from_millis(5))
                }
            }
        }
    }

    /// The name of the device at `index` (as `Done::device` gives it).
    pub fn device_name(&self, index: usize) -> Option<&str> {
        self.shared
            .devices
            .get(index)
            .map(|slot| slot.state.name.as_str())
    }

    pub fn devices(&self) -> Vec<DeviceView> {
        self.shared
            .devices
            .iter()
            .enumerate()
            .map(|(index, slot)| {
                let s = &slot.state;
                DeviceView {
                    name: s.name.clone(),
                    replicas: s.replicas,
                    healthy: s.is_routable(),
                    outstanding: s.outstanding.load(Ordering::Acquire),
                    queued: slot.queue.len(),
                    running: s.running.load(Ordering::Acquire),
                    service_s: s.service_s(),
                    prices: s.cost.prices(),
                    overrun: s.cost.overrun(),
                    expected_wait_s: self.shared.device_wait(index).map(|w| w.as_secs_f64()),
                }
            })
            .collect()
    }

    /// Sets a device's service time before (or instead of) measuring it, e.g. from a
    /// warm-up run, so that the first placements are informed.
    pub fn seed_service_time(&self, device: usize, per_request: Duration) {
        if let Some(slot) = self.shared.devices.get(device) {
            slot.state.seed_service_time(per_request);
        }
    }

    /// Requests each device queues beyond its running replicas.
    pub fn queue_capacity(&self) -> usize {
        self.shared.queue_capacity
    }

    /// Admitted requests not yet answered.
    pub fn in_flight(&self) -> usize {
        self.shared.in_flight.load(Ordering::Acquire)
    }

    /// The most requests admitted at once: `SchedulerConfig::max_in_flight`, or by default
    /// each device's replicas plus its queue capacity, summed (the one place that
    /// default is computed).
    pub fn admission_limit(&self) -> usize {
        self.shared.max_in_flight
    }

    /// Requests admitted since the start (answered or not).
    pub fn admitted(&self) -> u64 {
        self.shared.admitted.load(Ordering::Relaxed)
    }

    pub fn metrics(&self) -> &SchedMetrics {
        &self.shared.metrics
    }

    /// Brings the gauges (queue depth, in flight, health, service time) up to date;
    /// called before each scrape so that the request path never touches them.
    pub fn refresh_gauges(&self) {
        for slot in &self.shared.devices {
            let s = &slot.state;
            s.metrics.pending.set(slot.queue.len() as i64);
            s.metrics
                .in_flight
                .set(s.running.load(Ordering::Acquire) as i64);
            s.metrics.healthy.set(i64::from(s.is_routable()));
            s.metrics
                .service_ewma_us
                .set(s.service_s().unwrap_or(0.0) * 1e6);
        }
    }

    /// The first device lost for good (`Recovery::NeedsRestart`), as `device: why`: the
    /// server then drains and exits for the platform to restart it.
    pub fn lost_for_good(&self) -> Option<String> {
        self.shared.devices.iter().find_map(|d| {
            d.state
                .lost_for_good()
                .map(|why| format!("{}: {why}", d.state.name))
        })
    }

    /// Stops admitting, lets the replicas finish what is queued, and joins them.
    pub fn shutdown(&self) {
        self.shared.stopped.store(true, Ordering::Release);
        for slot in &self.shared.devices {
            for _ in 0..slot.state.replicas {
                slot.queue.push_stop();
            }
        }
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        for t in threads {
            let _ = t.join();
        }
    }
}

impl<E: Executor> Drop for Scheduler<E> {
    fn drop(&mut self) {
        // The replicas end when the last ticket lets go of the queues; the watchdog
        // ends at its next tick.
        self.shared.stopped.store(true, Ordering::Release);
    }
}

/// Where a request waits for its answer.
struct Placed<O> {
    device: usize,
    reply: oneshot::Receiver<Result<Done<O>, JobError>>,
    health: watch::Receiver<bool>,
}

fn ms(d: Duration) -> u64 {
    d.as_millis().min(u128::from(u64::MAX)) as u64
}

impl<E: Executor> Shared<E> {
    /// A device's service time per request, as rates and budgets count it: by count, the
    /// moving average; by cost, the mean run its cost model was fitted on, so that a wait
    /// priced by that model is weighed against a budget of the same memory (the moving
    /// average forgets a cold start's slow runs faster than the fit, and a budget in its
    /// service times then refused the fit's waits for the first seconds of load).
    fn service_s(&self, s: &DeviceState) -> Option<f64> {
        match self.scheduling {
            Scheduling::Cost => s.cost.mean_run_s().or_else(|| s.service_s()),
            Scheduling::Count => s.service_s(),
        }
    }

    /// Requests per second the healthy devices finish, and their replicas, from the
    /// measured service times; `None` before any is measured.
    fn throughput(&self) -> Option<(f64, usize)> {
        let (mut rate, mut replicas) = (0.0, 0);
        for slot in &self.devices {
            let s = &slot.state;
            if let (true, Some(service_s)) = (s.is_routable(), self.service_s(s)) {
                let working = s.replicas.saturating_sub(s.stuck.load(Ordering::Acquire));
                rate += working as f64 / service_s;
                replicas += working;
            }
        }
        (rate > 0.0 && replicas > 0).then_some((rate, replicas))
    }

    /// The queue budget now: fixed, or a number of the measured service times (`None`
    /// before one is measured: admission by count alone until then).
    fn queue_budget(&self) -> Option<Duration> {
        match self.max_queue_wait {
            QueueBudget::Off => None,
            QueueBudget::Fixed(d) => Some(d),
            QueueBudget::ServiceTimes(k) => {
                let (rate, replicas) = self.throughput()?;
                Some(Duration::from_secs_f64(
                    (k * replicas as f64 / rate).min(3600.0),
                ))
            }
        }
    }

    /// The expected time for `n` requests to finish at the devices' throughput.
    fn time_to_finish(&self, n: usize) -> Option<Duration> {
        let (rate, _) = self.throughput()?;
        Some(Duration::from_secs_f64((n as f64 / rate).min(3600.0)))
    }

    /// The expected wait before a replica starts a request that finds `ahead` admitted
    /// requests. By count: those beyond the replicas must finish first, at the devices'
    /// throughput. By cost: each device's wait (`device_wait`) weighed by its share of the
    /// throughput (where the router would send the work), plus the admitted requests not
    /// yet placed (being read or decoded) beyond the free replicas, at the throughput.
    fn expected_wait(&self, ahead: usize) -> Option<Duration> {
        let (rate, replicas) = self.throughput()?;
        if self.scheduling == Scheduling::Count {
            return self.time_to_finish((ahead + 1).saturating_sub(replicas));
        }
        let (mut placed, mut free, mut weighted) = (0, 0, 0.0);
        for (index, slot) in self.devices.iter().enumerate() {
            let s = &slot.state;
            let outstanding = s.outstanding.load(Ordering::Acquire);
            placed += outstanding;
            if let (true, Some(service_s)) = (s.is_routable(), self.service_s(s)) {
                let working = s.replicas.saturating_sub(s.stuck.load(Ordering::Acquire));
                free += working.saturating_sub(outstanding);
                let wait = self.device_wait(index).unwrap_or_default();
                weighted += working as f64 / service_s * wait.as_secs_f64();
            }
        }
        let unplaced = ahead.saturating_sub(placed);
        if unplaced < free {
            return Some(Duration::ZERO);
        }
        let s = (weighted + (unplaced - free) as f64) / rate;
        Some(Duration::from_secs_f64(s.min(3600.0)))
    }

    /// The expected wait before one of `device`'s replicas starts a request placed on it
    /// now, after everything queued there; `None` before its service time is measured.
    /// By cost, from the prices of the work ahead, unless some of it was priced by the
    /// prior (placed before the first run was measured): a guess refuses nothing, so the
    /// wait is then counted in measured service times.
    fn device_wait(&self, device: usize) -> Option<Duration> {
        let slot = &self.devices[device];
        let s = &slot.state;
        let service_s = self.service_s(s)?;
        Some(match self.scheduling {
            Scheduling::Cost if !self.guessing(device) => self.wait_on(device, slot.queue.cost()),
            Scheduling::Count | Scheduling::Cost => {
                let outstanding = s.outstanding.load(Ordering::Acquire);
                Duration::from_secs_f64(
                    estimated_completion(outstanding, s.replicas, service_s) - service_s,
                )
            }
        })
    }

    /// Whether work on `device`, queued or running, is priced by the prior: what is left
    /// of it is then a guess.
    fn guessing(&self, device: usize) -> bool {
        let slot = &self.devices[device];
        slot.state.running_guesses.load(Ordering::Acquire) > 0 || slot.queue.holds_guesses()
    }

    /// The wait on `device` of a request that runs after `queued` of its queued work: none
    /// while a replica is free, else what is left of the runs and that work, shared over
    /// the replicas that are not stuck.
    fn wait_on(&self, device: usize, queued: Duration) -> Duration {
        let s = &self.devices[device].state;
        let working = s
            .replicas
            .saturating_sub(s.stuck.load(Ordering::Acquire))
            .max(1);
        if s.outstanding.load(Ordering::Acquire) < working {
            return Duration::ZERO;
        }
        (s.running_left() + queued) / working as u32
    }

    /// `work`'s price on `device`: its own cost model's; before its first run, the
    /// fastest measured device's (so that it gets tried and measured), or the prior.
    /// Whether it is measured on this device: another device's price (a CPU's, for a GPU
    /// whose engines just loaded), the prior, and this device's own for an image over
    /// twice the largest it has measured (an extrapolation) order requests, but refuse
    /// none for their deadline (a guess is no reason to refuse).
    fn price(&self, device: usize, work: Work) -> (Duration, bool) {
        let cost = &self.devices[device].state.cost;
        if let Some(prices) = cost.prices() {
            return (prices.predict(work), cost.covers(work));
        }
        let borrowed = self
            .devices
            .iter()
            .filter(|slot| slot.state.is_routable())
            .filter_map(|slot| slot.state.cost.prices())
            .map(|p| p.predict(work))
            .min();
        (
            borrowed.unwrap_or_else(|| Prices::PRIOR.predict(work)),
            false,
        )
    }

    fn count_rejection(&self, e: &SubmitError) {
        let reason = match e {
            SubmitError::Overloaded { .. } => "overloaded",
            SubmitError::WaitTooLong { .. } => "wait_too_long",
            SubmitError::DeadlineUnreachable { .. } => "deadline_unreachable",
            SubmitError::AdmittedFirst { .. } => "admitted_first",
            SubmitError::NoHealthyDevice => "no_healthy_device",
            SubmitError::Stopped => "stopped",
        };
        self.metrics
            .rejected
            .get_or_create(&ReasonLabel { reason })
            .inc();
    }

    fn enqueue(
        &self,
        input: E::Input,
        terms: &Terms,
        exclude: Option<usize>,
    ) -> Result<Placed<E::Output>, SubmitError> {
        let attempt = |input| {
            // Microseconds: a plan of at most a queue's jobs per device.
            let _placing = self.placing.lock().unwrap_or_else(|p| p.into_inner());
            self.place(exclude, terms, Probe::Claim)
                .map_err(Unsent::Refused)
                .and_then(|placement| self.send_to(placement, input, terms))
        };
        let result = match attempt(input) {
            // The interim device retired between the choice and the push: once more,
            // where the router sends requests now.
            Err(Unsent::Retired(input)) => attempt(input),
            result => result,
        };
        result.map_err(|unsent| {
            let e = match unsent {
                Unsent::Refused(e) => e,
                Unsent::Retired(_) => SubmitError::Stopped,
            };
            self.count_rejection(&e);
            e
        })
    }

    /// Whether the router may place a request on `device` now: not excluded, routable,
    /// and loaded; before any device has loaded, the interim device if there is one (it
    /// loads first), else any, where the request waits for the load.
    fn usable(&self, device: usize, exclude: Option<usize>) -> bool {
        let s = &self.devices[device].state;
        if Some(device) == exclude || !s.is_routable() {
            return false;
        }
        if s.has_loaded() {
            return true;
        }
        let routable = || {
            self.devices
                .iter()
                .map(|d| &d.state)
                .filter(|d| d.is_routable())
        };
        !routable().any(|d| d.has_loaded()) && (s.interim || !routable().any(|d| d.interim))
    }

    /// Once every device that stays has loaded, an interim device takes no new request:
    /// its queue closes (a request placed on it meanwhile goes elsewhere), and its
    /// replicas finish what it holds and end, giving back their memory.
    fn retire_interim(&self) {
        let mut lasting = self.devices.iter().filter(|d| !d.state.interim).peekable();
        if lasting.peek().is_none() || !lasting.all(|d| d.state.all_loaded()) {
            return;
        }
        for slot in self.devices.iter().filter(|d| d.state.interim) {
            let s = &slot.state;
            if !s.retired.swap(true, Ordering::AcqRel) {
                slot.queue.close();
                tracing::info!(
                    device = %s.name,
                    finishing = s.outstanding.load(Ordering::Acquire),
                    "every other device has loaded: the interim device takes no new request, \
                     finishes those it holds and unloads"
                );
            }
        }
    }

    fn overloaded(&self) -> SubmitError {
        SubmitError::Overloaded {
            capacity: self.queue_capacity,
            retry_after_ms: self.time_to_finish(1).map_or(1000, ms),
        }
    }

    /// Whether a request that `device`'s prices refuse goes to it anyway, as a probe of
    /// those prices: the device is idle, its newest run ended at least `reprobe_after`
    /// ago, and no other probe was sent to it within that time (one wins the claim). A
    /// probe that runs faster than its price restarts the device's cost model from its
    /// run, and one faster than its price with the margin restarts the margin
    /// (`CostModel::restart_if_overpriced`); see `REPROBE_AFTER` for why.
    fn may_probe(&self, device: usize, probe: Probe) -> bool {
        let s = &self.devices[device].state;
        let last_run = s.last_run_ns.load(Ordering::Acquire);
        if last_run == 0 || s.outstanding.load(Ordering::Acquire) != 0 {
            return false;
        }
        let now = s.now_ns();
        let after = u64::try_from(self.reprobe_after.as_nanos()).unwrap_or(u64::MAX);
        let last_probe = s.last_probe_ns.load(Ordering::Acquire);
        let due = now.saturating_sub(last_run) >= after && now.saturating_sub(last_probe) >= after;
        if probe == Probe::Peek {
            return due;
        }
        let claimed = due
            && s.last_probe_ns
                .compare_exchange(last_probe, now, Ordering::AcqRel, Ordering::Acquire)
                .is_ok();
        if claimed {
            s.metrics.probes.inc();
            tracing::info!(
                device = %s.name,
                idle_s = format!("{:.1}", (now - last_run) as f64 / 1e9),
                "no run while the device's prices refused work: a request they refuse runs, to measure them again"
            );
        }
        claimed
    }

    /// The deadline a request's run is kept by on its device. By cost, the run's own
    /// (`Terms::run_deadline`): a run that ends later answers late, after its encode. By
    /// count, the request's, as a count-based router has it.
    fn kept_deadline(&self, terms: &Terms) -> Instant {
        match self.scheduling {
            Scheduling::Cost => terms.run_deadline(),
            Scheduling::Count => terms.deadline,
        }
    }

    /// The device for the next request under the routing policy, and the request's
    /// price there. By cost, a request is refused here, at once, only when no device it
    /// is offered to (`choices`) would finish it by its deadline (`admission`).
    fn place(
        &self,
        exclude: Option<usize>,
        terms: &Terms,
        probe: Probe,
    ) -> Result<Placement, SubmitError> {
        let now = Instant::now();
        let by_cost = self.scheduling == Scheduling::Cost;
        // When `device` would finish the request: its price, whether measured, and the
        // expected completion (by count, none: the price only orders nothing there).
        let priced = |device: usize| -> Priced {
            let (cost, measured) = self.price(device, terms.work);
            if !by_cost {
                return (cost, measured, Duration::ZERO);
            }
            let ahead = self.devices[device]
                .queue
                .cost_ahead(&Entry::placed(terms, cost, measured, cost, now));
            (cost, measured, self.wait_on(device, ahead) + cost)
        };
        let choices: Vec<(usize, Priced)> = self
            .choices(exclude, &priced)?
            .into_iter()
            .map(|(device, known)| (device, known.unwrap_or_else(|| priced(device))))
            .collect();
        let refusals = match first_admitted(choices, |&(device, priced)| {
            self.admission(device, priced, terms, now)
        }) {
            Ok(placement) => return Ok(placement),
            Err(refusals) => refusals,
        };
        // A device due a probe of its prices takes a request they refuse.
        let due = refusals
            .iter()
            .find(|(_, (placement, _))| self.may_probe(placement.device, probe));
        if let Some((_, (placement, _))) = due {
            return Ok(Placement {
                probe: true,
                ..*placement
            });
        }
        Err(refusals
            .into_iter()
            .next()
            .map_or(SubmitError::NoHealthyDevice, |(_, (_, e))| e))
    }

    /// The devices the routing policy offers the next request to, in that order, with
    /// its price where the policy priced it: least busy by cost offers every open device,
    /// earliest expected completion first (`choice::by_completion`), so that a request
    /// the first cannot finish in time goes to another that can; every other policy
    /// offers the one device it picks.
    fn choices(
        &self,
        exclude: Option<usize>,
        priced: &dyn Fn(usize) -> Priced,
    ) -> Result<Vec<(usize, Option<Priced>)>, SubmitError> {
        let n = self.devices.len();
        let open = |i: usize| self.usable(i, exclude) && !self.devices[i].full(self.queue_capacity);
        let none_open = || {
            if (0..n).any(|i| self.usable(i, exclude)) {
                self.overloaded()
            } else {
                SubmitError::NoHealthyDevice
            }
        };
        let start = self.cursor.fetch_add(1, Ordering::Relaxed);
        // From the cursor, so that ties rotate.
        let rotated = (0..n).map(|k| (start + k) % n);
        let device = match self.routing {
            Routing::LeastBusy if self.scheduling == Scheduling::Cost => {
                let open: Vec<(usize, Priced)> = rotated
                    .filter(|&i| open(i))
                    .map(|i| (i, priced(i)))
                    .collect();
                if open.is_empty() {
                    return Err(none_open());
                }
                return Ok(by_completion(open, |p| p.2)
                    .into_iter()
                    .map(|(i, p)| (i, Some(p)))
                    .collect());
            }
            Routing::LeastBusy => {
                // A device not measured yet counts as fast as the fastest measured one,
                // so that it gets tried and measured.
                let fastest = (0..n)
                    .filter(|&i| self.usable(i, exclude))
                    .filter_map(|i| self.devices[i].state.service_s())
                    .fold(f64::INFINITY, f64::min);
                let fallback = if fastest.is_finite() { fastest } else { 1.0 };
                let estimate = |i: usize| {
                    let s = &self.devices[i].state;
                    estimated_completion(
                        s.outstanding.load(Ordering::Acquire),
                        s.replicas,
                        s.service_s().unwrap_or(fallback),
                    )
                };
                let mut best: Option<(usize, f64)> = None;
                for i in rotated.filter(|&i| open(i)) {
                    let e = estimate(i);
                    if best.is_none_or(|(_, b)| e < b) {
                        best = Some((i, e));
                    }
                }
                best.map(|(i, _)| i).ok_or_else(none_open)?
            }
            Routing::LeastOutstanding => rotated
                .filter(|&i| open(i))
                .min_by_key(|&i| self.devices[i].state.outstanding.load(Ordering::Acquire))
                .ok_or_else(none_open)?,
            Routing::RoundRobin => {
                let mut rotated = rotated;
                rotated
                    .find(|&i| self.usable(i, exclude))
                    .ok_or(SubmitError::NoHealthyDevice)?
            }
            Routing::Random => {
                let healthy = (0..n).filter(|&i| self.usable(i, exclude)).count();
                if healthy == 0 {
                    return Err(SubmitError::NoHealthyDevice);
                }
                let pick = fastrand::usize(..healthy);
                (0..n)
                    .filter(|&i| self.usable(i, exclude))
                    .nth(pick)
                    .ok_or(SubmitError::NoHealthyDevice)?
            }
        };
        Ok(vec![(device, None)])
    }

    /// Whether `device` takes a request of `terms` priced there at `priced`, placed now:
    /// by cost, on measured prices, not when it would finish after its deadline, or make
    /// a queued request late (`queue::fit`). Refused, the placement it would have had,
    /// and why.
    fn admission(
        &self,
        device: usize,
        (cost, measured, done): Priced,
        terms: &Terms,
        now: Instant,
    ) -> Result<Placement, (Placement, SubmitError)> {
        // Kept with the device's overrun: admitted on the expected completion, a request
        // would miss its deadline whenever the runs ahead of it, or its own, are slower
        // than their prices.
        let overrun = self.devices[device].state.cost.overrun();
        let worst = cost.mul_f64(overrun);
        let placement = Placement {
            device,
            cost,
            measured,
            worst,
            probe: false,
        };
        // Refused only on measured prices: its own, and those of the work ahead of it.
        if self.scheduling != Scheduling::Cost || !measured || self.guessing(device) {
            return Ok(placement);
        }
        let left = terms.deadline.saturating_duration_since(now);
        // Its answer's encode, after the run, is the request's time too.
        let done = done.mul_f64(overrun) + terms.answer;
        let refusal = if done > left {
            SubmitError::DeadlineUnreachable {
                expected_ms: ms(done),
                deadline_ms: ms(left),
                retry_after_ms: ms(done - left).max(1),
            }
        } else {
            let entry = Entry::placed(terms, cost, measured, worst, now);
            match self.fit(device, entry, overrun, now) {
                Fit::Fits => return Ok(placement),
                Fit::Late(end) => {
                    // Planned run by run, its wait is longer than the shared one.
                    let done = end.saturating_duration_since(now) + terms.answer;
                    SubmitError::DeadlineUnreachable {
                        expected_ms: ms(done),
                        deadline_ms: ms(left),
                        retry_after_ms: ms(done.saturating_sub(left)).max(1),
                    }
                }
                Fit::Harms { until } => SubmitError::AdmittedFirst {
                    retry_after_ms: ms(until.saturating_duration_since(now)).max(1),
                },
            }
        };
        Err((placement, refusal))
    }

    /// When each of `device`'s replicas is free, its run taking what it may at worst
    /// (its price times `overrun`): now for an idle one, or one past that.
    fn free_at(&self, device: usize, overrun: f64, now: Instant) -> Vec<Instant> {
        let s = &self.devices[device].state;
        s.running_started_ns
            .iter()
            .zip(&s.running_cost_ns)
            .map(|(started, cost)| match started.load(Ordering::Acquire) {
                0 => now,
                started => {
                    let cost = Duration::from_nanos(cost.load(Ordering::Acquire));
                    (s.epoch + Duration::from_nanos(started) + cost.mul_f64(overrun)).max(now)
                }
            })
            .collect()
    }

    /// What placing a job of `entry` on `device` now does to the device's plan
    /// (`queue::fit`).
    fn fit(&self, device: usize, entry: Entry, overrun: f64, now: Instant) -> Fit {
        let slot = &self.devices[device];
        if !slot.one_at_a_time {
            return Fit::Fits;
        }
        fit(
            &slot.queue.entries(),
            entry,
            &self.free_at(device, overrun, now),
        )
    }

    fn send_to(
        &self,
        placement: Placement,
        input: E::Input,
        terms: &Terms,
    ) -> Result<Placed<E::Output>, Unsent<E::Input>> {
        let device = placement.device;
        let slot = &self.devices[device];
        if slot.full(self.queue_capacity) {
            return Err(Unsent::Refused(self.overloaded()));
        }
        let (reply, receiver) = oneshot::channel();
        let health = slot.state.watch_health();
        let job = Job {
            input,
            work: terms.work,
            cost: placement.cost,
            measured: placement.measured,
            worst: placement.worst,
            probe: placement.probe,
            priority: terms.priority.level(),
            enqueued: Instant::now(),
            deadline: self.kept_deadline(terms),
            server_deadline: terms.server_deadline,
            reply,
            _outstanding: Outstanding::new(&slot.state),
        };
        match slot.queue.push(job) {
            Ok(()) => Ok(Placed {
                device,
                reply: receiver,
                health,
            }),
            Err(PushError::Full(_)) => Err(Unsent::Refused(self.overloaded())),
            Err(PushError::Closed(job)) if slot.state.retired.load(Ordering::Acquire) => {
                Err(Unsent::Retired(job.input))
            }
            Err(PushError::Closed(_)) => Err(Unsent::Refused(SubmitError::Stopped)),
        }
    }

    /// One watchdog round: retire an interim device once the others have loaded, catch
    /// runs past their deadline, move queued requests off unhealthy devices, and check
    /// those devices.
    fn check_health(&self) {
        self.retire_interim();
        for slot in &self.devices {
            let s = &slot.state;
            let now = s.now_ns();
            for running in &s.running_deadline_ns {
                let deadline = running.load(Ordering::Acquire);
                // Cleared once reported, so that a stuck run is reported once.
                if deadline != 0
                    && now > deadline
                    && running
                        .compare_exchange(deadline, 0, Ordering::AcqRel, Ordering::Acquire)
                        .is_ok()
                {
                    // The replica's own thread takes it back off when the run ends.
                    let stuck = s.stuck.fetch_add(1, Ordering::AcqRel) + 1;
                    s.metrics.stuck_runs.inc();
                    s.metrics.stuck.set(stuck as i64);
                    tracing::warn!(
                        device = %s.name,
                        stuck,
                        replicas = s.replicas,
                        "a replica's run went past its request's deadline: routed around until it ends"
                    );
                    if stuck >= s.replicas {
                        s.mark_unhealthy("every replica is running past a deadline");
                    }
                }
            }
            if s.stuck_is_lost.load(Ordering::Acquire) && has_hung_run(s, now) {
                let why = "a replica's run is stuck past its deadline (a hung GPU: nothing \
                           interrupts a kernel that never ends), so it cannot be recovered \
                           in this process";
                if s.mark_lost_for_good(why) {
                    tracing::error!(
                        device = %s.name,
                        reason = why,
                        "GPU lost: it cannot come back in this process; out of service, and the server restarts"
                    );
                }
            }
            if s.is_healthy() {
                continue;
            }
            for job in slot.queue.drain_jobs() {
                job.fail(JobError::DeviceUnhealthy {
                    device: s.name.clone(),
                });
            }
            if s.lost_for_good().is_some() {
                // Never checked again: a check would be a call on the lost device.
                continue;
            }
            let due = now.saturating_sub(s.last_health_check_ns.load(Ordering::Acquire))
                >= self.health_check_interval.as_nanos() as u64;
            if due && !s.health_check_pending.load(Ordering::Acquire) {
                s.health_check_pending.store(true, Ordering::Release);
                s.last_health_check_ns.store(now, Ordering::Release);
                slot.queue.push_health_check();
            }
        }
    }
}

/// How long a run reported stuck (past its server deadline) must have been running for
/// a device whose stuck runs mean it is lost (`Executor::stuck_is_lost`) to be lost for
/// good: a run that started just before its deadline and ends a moment after it is late,
/// not hung.
const HUNG_RUN_AFTER: Duration = Duration::from_secs(5);

/// Whether a replica of `s` runs a batch the watchdog reported stuck (its deadline slot
/// cleared while it still holds the run) for `HUNG_RUN_AFTER` or more, at `now`.
fn has_hung_run(s: &DeviceState, now: u64) -> bool {
    if s.stuck.load(Ordering::Acquire) == 0 || s.lost_for_good().is_some() {
        return false;
    }
    let after = HUNG_RUN_AFTER.as_nanos() as u64;
    s.running_deadline_ns
        .iter()
        .zip(&s.running_started_ns)
        .any(|(deadline, started)| {
            let started = started.load(Ordering::Acquire);
            deadline.load(Ordering::Acquire) == 0
                && started != 0
                && now.saturating_sub(started) >= after
        })
}

/// Why a request was not queued on the device chosen for it.
enum Unsent<I> {
    Refused(SubmitError),
    /// The device was an interim one that retired meanwhile: the request, to place again.
    Retired(I),
}

/// What a placement does with a probe a device is due (`Shared::may_probe`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    /// Sends the request as the probe: one request wins it.
    Claim,
    /// Only says whether the request would be sent (a check before the placement).
    Peek,
}

/// A request's price on a device, whether it is measured there, and its expected
/// completion there (`Shared::place`).
type Priced = (Duration, bool, Duration);

/// Where the router put a request, and its price there.
#[derive(Debug, Clone, Copy)]
struct Placement {
    device: usize,
    cost: Duration,
    /// Whether `cost` is measured on this device, not borrowed or the prior.
    measured: bool,
    /// `cost` times the device's overrun: what the run may take at worst.
    worst: Duration,
    /// Sent although its prices refused it, to measure them again (`Shared::may_probe`).
    probe: bool,
}

fn watchdog<E: Executor>(shared: Weak<Shared<E>>, tick: Duration) {
    loop {
        std::thread::sleep(tick);
        let Some(shared) = shared.upgrade() else {
            return;
        };
        if shared.stopped.load(Ordering::Acquire) {
            return;
        }
        shared.check_health();
    }
}

/// An in-flight slot taken by `Scheduler::admit`; `Scheduler::submit_admitted` turns it into
/// a `Ticket`. Dropping it gives the slot back. Not generic over the executor, so that
/// a handler can hold it across awaits (reading and decoding the body).
#[derive(Debug)]
pub struct Admission {
    in_flight: Arc<AtomicUsize>,
    admitted: Instant,
    /// False once a ticket owns the slot.
    holds_slot: bool,
}

impl Drop for Admission {
    fn drop(&mut self) {
        if self.holds_slot {
            self.in_flight.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// The future of a request's result (see `Ticket::wait`).
pub type Answer<O> = Pin<Box<dyn Future<Output = Result<Done<O>, JobError>> + Send>>;

/// An admitted request. `wait` gives its result; dropping the ticket abandons it (a
/// queued request whose ticket is gone is skipped, not run).
pub struct Ticket<E: Executor> {
    shared: Arc<Shared<E>>,
    input: E::Input,
    terms: Terms,
    admitted: Instant,
    /// Where the request is queued now (moved once on fail-over).
    placed: Placed<E::Output>,
    failed_over: bool,
}

impl<E: Executor> Ticket<E> {
    /// The device the request is queued on now.
    pub fn device(&self) -> Option<usize> {
        Some(self.placed.device)
    }

    /// Waits for the result until the deadline. A device fault (a failed run, a device
    /// marked unhealthy while it holds the request) moves the request once to another
    /// device.
    ///
    /// Boxed because rustc cannot prove an `async fn` future `Send` when it holds this
    /// one for a boxed `dyn Executor` (a higher-ranked lifetime error in handlers); the
    /// bound proven here, once, for any `E`, avoids it.
    pub fn wait(self) -> Answer<E::Output> {
        Box::pin(self.wait_inner())
    }

    async fn wait_inner(mut self) -> Result<Done<E::Output>, JobError> {
        loop {
            let placed = &mut self.placed;
            let device = placed.device;
            let state = self.shared.devices[device].state.clone();
            let outcome = tokio::select! {
                biased;
                reply = &mut placed.reply => reply.unwrap_or_else(|_| Err(JobError::Dropped {
                    device: state.name.clone(),
                })),
                // Before the health signal: the watchdog marks a device unhealthy when a
                // run passes its deadline, and that request's answer is its deadline.
                () = tokio::time::sleep_until(self.terms.deadline.into()) => Err(JobError::DeadlineExceeded),
                // A timer past its deadline fires on the timer's next turn, not at its
                // first poll, while a lost device's signal is ready at once: a ticket
                // first polled after both (a busy machine) is still answered by its
                // deadline.
                () = health_lost(&mut placed.health) => Err(if Instant::now() >= self.terms.deadline {
                    JobError::DeadlineExceeded
                } else {
                    JobError::DeviceUnhealthy {
                        device: state.name.clone(),
                    }
                }),
            };
            let m = &state.metrics;
            match outcome {
                Ok(mut done) => {
                    done.failed_over = self.failed_over;
                    m.success.inc();
                    m.request_us.observe(us(self.admitted.elapsed()));
                    return Ok(done);
                }
                Err(e)
                    if e.is_device_fault()
                        && !self.failed_over
                        && Instant::now() < self.terms.deadline =>
                {
                    self.failed_over = true;
                    m.failover.inc();
                    tracing::warn!(device = %state.name, error = %e, "failing the request over to another device");
                    match self
                        .shared
                        .enqueue(self.input.clone(), &self.terms, Some(device))
                    {
                        Ok(next) => self.placed = next,
                        // A run that failed, with nowhere else to go, is that run's error
                        // (the server's), not an overload.
                        Err(_) if matches!(e, JobError::Failed { .. }) => {
                            m.failure(e.reason());
                            return Err(e);
                        }
                        Err(refused) => return Err(JobError::Rejected(refused)),
                    }
                }
                Err(e) => {
                    m.failure(e.reason());
                    return Err(e);
                }
            }
        }
    }
}

/// Resolves once the watched device is unhealthy (at once if it already is).
async fn health_lost(health: &mut watch::Receiver<bool>) {
    loop {
        let healthy = *health.borrow_and_update();
        if !healthy {
            return;
        }
        if health.changed().await.is_err() {
            // The device is gone with its router: the reply channel says so instead.
            std::future::pending::<()>().await;
        }
    }
}

impl<E: Executor> Drop for Ticket<E> {
    fn drop(&mut self) {
        self.shared.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::{estimated_completion, QueueBudget};

    #[test]
    fn a_queue_budget_is_a_time_service_times_or_off() {
        let parse = |s: &str| s.parse::<QueueBudget>();
        assert_eq!(parse("off"), Ok(QueueBudget::Off));
        assert_eq!(parse("2x"), Ok(QueueBudget::ServiceTimes(2.0)));
        assert_eq!(parse("0.5x"), Ok(QueueBudget::ServiceTimes(0.5)));
        assert_eq!(
            parse("250ms"),
            Ok(QueueBudget::Fixed(Duration::from_millis(250)))
        );
        assert_eq!(parse("2s"), Ok(QueueBudget::Fixed(Duration::from_secs(2))));
        for wrong in ["", "0x", "-1ms", "0ms", "2", "soon", "infx"] {
            assert!(parse(wrong).is_err(), "{wrong}");
        }
        // What the start-up log prints parses back to the same budget.
        for budget in [QueueBudget::Off, QueueBudget::ServiceTimes(2.0)] {
            assert_eq!(parse(&budget.to_string()), Ok(budget));
        }
    }

    #[test]
    fn estimate_counts_the_request_and_the_free_replicas() {
        // Idle: just its own service time.
        assert_eq!(estimated_completion(0, 1, 2.0), 2.0);
        // One ahead on one replica: wait one, then run.
        assert_eq!(estimated_completion(1, 1, 2.0), 4.0);
        // A free replica among two: no wait.
        assert_eq!(estimated_completion(1, 2, 2.0), 2.0);
        // Two busy replicas: half a service time of waiting on average.
        assert_eq!(estimated_completion(2, 2, 2.0), 3.0);
        // A fast busy device can beat a slow idle one, and not when it is busier.
        assert!(estimated_completion(1, 1, 1.0) < estimated_completion(0, 1, 2.5));
        assert!(estimated_completion(3, 1, 1.0) > estimated_completion(0, 1, 2.5));
    }
}

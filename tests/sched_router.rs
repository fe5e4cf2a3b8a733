//! The router through its public API, on gated test devices (see `sched_support`): the
//! test decides when each run finishes and whether it fails, so every assertion is about
//! order and counts, never about how long something took.

mod sched_support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use celer::sched::metrics::DeviceLabel;
use celer::sched::sim::{drive, sim_devices, Arrivals, LoadSpec, ServiceTime, SizeClass};
use celer::sched::{
    Done, JobError, QueueBudget, Routing, Scheduler, SchedulerConfig, Scheduling, SubmitError,
    Ticket,
};
use celer::spec::BatchingSpec;
use sched_support::{eventually, gated, Gate, GateExecutor};

fn far() -> Instant {
    Instant::now() + Duration::from_secs(600)
}

fn answer(ticket: Ticket<GateExecutor>) -> Result<Done<u32>, JobError> {
    tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .expect("runtime")
        .block_on(ticket.wait())
}

/// Waits for `ticket` on its own thread, so that fail-over can proceed meanwhile.
fn answer_later(
    ticket: Ticket<GateExecutor>,
) -> std::thread::JoinHandle<Result<Done<u32>, JobError>> {
    std::thread::spawn(move || answer(ticket))
}

fn start(
    devices: Vec<celer::sched::DeviceSetup<GateExecutor>>,
    config: SchedulerConfig,
) -> Scheduler<GateExecutor> {
    let router = Scheduler::start(devices, config);
    router.wait_ready().expect("gate devices load");
    router
}

const OFF: BatchingSpec = BatchingSpec::OFF;

#[test]
fn least_busy_places_by_estimated_completion() {
    let (fast, slow) = (Gate::closed(), Gate::closed());
    let router = start(
        vec![gated("fast", 1, OFF, &fast), gated("slow", 1, OFF, &slow)],
        SchedulerConfig::default(),
    );
    router.seed_service_time(0, Duration::from_millis(10));
    router.seed_service_time(1, Duration::from_millis(25));
    // Nothing finishes: each request adds one service time to its device's estimate.
    // fast: 10, 20, 30, 40 ms; slow: 25, 50 ms.
    let tickets: Vec<_> = (0..5)
        .map(|id| router.submit(id, far()).expect("admitted"))
        .collect();
    let placed: Vec<usize> = tickets.iter().filter_map(Ticket::device).collect();
    assert_eq!(placed, [0, 0, 1, 0, 0]);
    assert_eq!(router.devices()[0].outstanding, 4);
    assert_eq!(router.devices()[1].outstanding, 1);

    fast.set_open(true);
    slow.set_open(true);
    for t in tickets {
        assert!(answer(t).is_ok());
    }
    router.shutdown();
}

#[test]
fn an_unmeasured_device_is_tried_before_a_busy_measured_one() {
    let (a, b) = (Gate::closed(), Gate::closed());
    let router = start(
        vec![gated("a", 1, OFF, &a), gated("b", 1, OFF, &b)],
        SchedulerConfig::default(),
    );
    router.seed_service_time(0, Duration::from_millis(10));
    let first = router.submit(0, far()).expect("admitted");
    let second = router.submit(1, far()).expect("admitted");
    assert_eq!(first.device(), Some(0));
    // b counts as fast as a: idle b (10 ms) beats busy a (20 ms).
    assert_eq!(second.device(), Some(1));
    a.set_open(true);
    b.set_open(true);
    assert!(answer(first).is_ok() && answer(second).is_ok());
    router.shutdown();
}

#[test]
fn round_robin_and_random_are_the_baselines() {
    let gates = [Gate::closed(), Gate::closed(), Gate::closed()];
    let devices = |gates: &[Arc<Gate>; 3]| {
        gates
            .iter()
            .enumerate()
            .map(|(i, g)| gated(&format!("d{i}"), 1, OFF, g))
            .collect::<Vec<_>>()
    };
    let rr = start(
        devices(&gates),
        SchedulerConfig {
            routing: Routing::RoundRobin,
            // Seeded so that least busy would send everything to d2.
            ..SchedulerConfig::default()
        },
    );
    rr.seed_service_time(2, Duration::from_nanos(1));
    let tickets: Vec<_> = (0..6)
        .map(|id| rr.submit(id, far()).expect("admitted"))
        .collect();
    let placed: Vec<usize> = tickets.iter().filter_map(Ticket::device).collect();
    assert_eq!(placed, [0, 1, 2, 0, 1, 2]);

    let random = start(
        devices(&gates),
        SchedulerConfig {
            routing: Routing::Random,
            queue_capacity: 100,
            ..SchedulerConfig::default()
        },
    );
    random.seed_service_time(2, Duration::from_nanos(1));
    let more: Vec<_> = (0..150)
        .map(|id| random.submit(id, far()).expect("admitted"))
        .collect();
    let mut per_device = [0; 3];
    for t in &more {
        per_device[t.device().expect("placed")] += 1;
    }
    // Uniform placement reaches every device (missing one has probability ~1e-26).
    assert!(per_device.iter().all(|&n| n > 0), "{per_device:?}");

    for g in &gates {
        g.set_open(true);
    }
    for t in tickets.into_iter().chain(more) {
        assert!(answer(t).is_ok());
    }
    rr.shutdown();
    random.shutdown();
}

#[test]
fn a_failing_device_is_avoided_until_a_health_check_passes() {
    let (bad, good) = (Gate::open(), Gate::open());
    bad.set_failing(true);
    let router = start(
        vec![gated("bad", 1, OFF, &bad), gated("good", 1, OFF, &good)],
        SchedulerConfig {
            unhealthy_after_failures: 2,
            health_check_interval: Duration::from_millis(20),
            ..SchedulerConfig::default()
        },
    );
    // bad looks fastest, so it gets every request while it is healthy.
    router.seed_service_time(0, Duration::from_nanos(1));
    for id in 0..2 {
        let ticket = router.submit(id, far()).expect("admitted");
        assert_eq!(ticket.device(), Some(0));
        let done = answer(ticket).expect("failed over to the good device");
        assert_eq!((done.device, done.failed_over), (1, true));
    }
    assert!(!router.devices()[0].healthy, "two failures in a row");
    for id in 2..10 {
        let ticket = router.submit(id, far()).expect("admitted");
        assert_eq!(
            ticket.device(),
            Some(1),
            "no traffic to an unhealthy device"
        );
        let done = answer(ticket).expect("served");
        assert!(!done.failed_over);
    }
    assert_eq!(bad.ran().len(), 2);

    bad.set_failing(false);
    eventually("a health check passes", || router.devices()[0].healthy);
    assert!(bad.health_checks() >= 1);
    router.seed_service_time(0, Duration::from_nanos(1));
    let ticket = router.submit(10, far()).expect("admitted");
    assert_eq!(
        ticket.device(),
        Some(0),
        "traffic again after the health check"
    );
    assert_eq!(answer(ticket).expect("served").device, 0);
    router.shutdown();
}

#[test]
fn in_flight_work_fails_over_once() {
    let (first, second) = (Gate::closed(), Gate::open());
    let router = start(
        vec![
            gated("first", 1, OFF, &first),
            gated("second", 1, OFF, &second),
        ],
        SchedulerConfig {
            unhealthy_after_failures: 1,
            health_check_interval: Duration::from_secs(600),
            ..SchedulerConfig::default()
        },
    );
    router.seed_service_time(0, Duration::from_nanos(1));
    router.seed_service_time(1, Duration::from_secs(1));
    let running = router.submit(0, far()).expect("admitted");
    first.wait_entered(1);
    let queued = router.submit(1, far()).expect("admitted");
    assert_eq!((running.device(), queued.device()), (Some(0), Some(0)));
    let (running, queued) = (answer_later(running), answer_later(queued));

    // The running request fails; the device turns unhealthy; both move to `second`.
    first.set_failing(true);
    first.allow(1);
    for handle in [running, queued] {
        let done = handle
            .join()
            .expect("waiter")
            .expect("served after fail-over");
        assert_eq!((done.device, done.failed_over), (1, true));
    }
    assert_eq!(
        first.ran(),
        [vec![0]],
        "the queued request never ran on the failed device"
    );

    // Once only: when the second device fails too, the request fails.
    second.set_failing(true);
    router.seed_service_time(1, Duration::from_nanos(1));
    let ticket = router.submit(2, far()).expect("admitted");
    let error = answer(ticket).expect_err("nowhere left");
    assert!(
        matches!(error, JobError::Failed { .. } | JobError::Rejected(_)),
        "{error}"
    );
    first.set_open(true);
    router.shutdown();
}

#[test]
fn a_run_past_its_deadline_marks_the_device_unhealthy_and_moves_its_queue() {
    let (stuck, spare) = (Gate::closed(), Gate::open());
    let router = start(
        vec![
            gated("stuck", 1, OFF, &stuck),
            gated("spare", 1, OFF, &spare),
        ],
        SchedulerConfig {
            health_check_interval: Duration::from_millis(10),
            ..SchedulerConfig::default()
        },
    );
    router.seed_service_time(0, Duration::from_nanos(1));
    router.seed_service_time(1, Duration::from_secs(1));
    let hung = router
        .submit(0, Instant::now() + Duration::from_millis(100))
        .expect("admitted");
    stuck.wait_entered(1);
    let behind = answer_later(router.submit(1, far()).expect("admitted"));

    let hung = answer(hung).map(|d| d.device);
    assert!(matches!(hung, Err(JobError::DeadlineExceeded)), "{hung:?}");
    let done = behind.join().expect("waiter").expect("moved to the spare");
    assert_eq!((done.device, done.failed_over), (1, true));
    assert!(!router.devices()[0].healthy);

    // The stuck run ends; the next health check passes.
    stuck.set_open(true);
    eventually("the stuck device recovers", || router.devices()[0].healthy);
    router.shutdown();
}

#[test]
fn overload_is_refused_at_once_and_memory_stays_bounded() {
    let gate = Gate::closed();
    let router = start(
        vec![gated("only", 1, OFF, &gate)],
        SchedulerConfig {
            queue_capacity: 2,
            ..SchedulerConfig::default()
        },
    );
    let running = router.submit(0, far()).expect("admitted");
    gate.wait_entered(1);
    let queued: Vec<_> = (1..3)
        .map(|id| router.submit(id, far()).expect("admitted"))
        .collect();
    for id in 3..10_003 {
        match router.submit(id, far()) {
            Err(SubmitError::Overloaded { .. }) => {}
            other => panic!(
                "request {id}: expected Overloaded, got {:?}",
                other.map(|t| t.device())
            ),
        }
    }
    // One running, two queued: nothing else was kept.
    assert_eq!(router.in_flight(), 3);
    assert_eq!(router.devices()[0].outstanding, 3);
    assert_eq!(router.devices()[0].queued, 2);

    gate.set_open(true);
    assert!(answer(running).is_ok());
    for t in queued {
        assert!(answer(t).is_ok());
    }
    assert_eq!(router.in_flight(), 0);
    router.shutdown();
}

#[test]
fn the_global_in_flight_limit_refuses_before_any_queue_is_full() {
    let (a, b) = (Gate::closed(), Gate::closed());
    let router = start(
        vec![gated("a", 1, OFF, &a), gated("b", 1, OFF, &b)],
        SchedulerConfig {
            queue_capacity: 16,
            max_in_flight: Some(3),
            ..SchedulerConfig::default()
        },
    );
    let held: Vec<_> = (0..3)
        .map(|id| router.submit(id, far()).expect("admitted"))
        .collect();
    assert!(matches!(
        router.submit(3, far()),
        Err(SubmitError::Overloaded { capacity: 3, .. })
    ));
    a.set_open(true);
    b.set_open(true);
    for t in held {
        assert!(answer(t).is_ok());
    }
    assert!(router.submit(4, far()).is_ok());
    router.shutdown();
}

#[test]
fn admission_by_time_refuses_when_the_expected_wait_is_over_the_budget() {
    let gate = Gate::closed();
    // By count: every request costs the measured service time, whatever is left of the
    // run going on.
    let router = start(
        vec![gated("slow", 1, OFF, &gate)],
        SchedulerConfig {
            queue_capacity: 16,
            max_queue_wait: QueueBudget::Fixed(Duration::from_millis(250)),
            scheduling: Scheduling::Count,
            ..SchedulerConfig::default()
        },
    );
    // 100 ms a request on one replica: the requests that find 0, 1 and 2 ahead of them
    // expect to wait 0, 100 and 200 ms; the next one 300 ms, over the budget, though
    // the queue has room by count.
    router.seed_service_time(0, Duration::from_millis(100));
    assert_eq!(router.estimated_wait(), Some(Duration::ZERO));
    let held: Vec<_> = (0..3)
        .map(|id| router.submit(id, far()).expect("admitted"))
        .collect();
    assert_eq!(router.estimated_wait(), Some(Duration::from_millis(300)));
    match router.submit(3, far()) {
        Err(
            e @ SubmitError::WaitTooLong {
                estimated_ms: 300,
                budget_ms: 250,
                retry_after_ms: 50,
            },
        ) => assert_eq!(e.retry_after(), Some(Duration::from_millis(50))),
        other => panic!("expected WaitTooLong, got {:?}", other.map(|_| ())),
    }
    // Refused at once, holding nothing.
    assert_eq!(router.in_flight(), 3);
    gate.set_open(true);
    for t in held {
        assert!(answer(t).is_ok());
    }
    assert!(router.submit(4, far()).is_ok());
    router.shutdown();
}

#[test]
fn admission_by_cost_counts_what_is_left_of_the_run_and_the_queued_work() {
    let gate = Gate::closed();
    // Prices of 100 s, so that the milliseconds this test takes are lost in them.
    let router = start(
        vec![gated("slow", 1, OFF, &gate)],
        SchedulerConfig {
            queue_capacity: 16,
            max_queue_wait: QueueBudget::Fixed(Duration::from_secs(250)),
            ..SchedulerConfig::default()
        },
    );
    router.seed_service_time(0, Duration::from_secs(100));
    let running = router.submit(0, far()).expect("admitted");
    gate.wait_entered(1);
    let queued: Vec<_> = (1..3)
        .map(|id| router.submit(id, far()).expect("admitted"))
        .collect();
    // Nearly 100 s left of the run, 200 s queued: just under 300 s, over the budget.
    let wait = router.estimated_wait().expect("measured");
    assert!(
        wait > Duration::from_secs(299) && wait <= Duration::from_secs(300),
        "{wait:?}"
    );
    match router.submit(3, far()) {
        Err(SubmitError::WaitTooLong {
            estimated_ms,
            budget_ms: 250_000,
            retry_after_ms,
        }) => {
            assert!(
                (299_000..=300_000).contains(&estimated_ms),
                "{estimated_ms}"
            );
            assert_eq!(retry_after_ms, estimated_ms - 250_000);
        }
        other => panic!("expected WaitTooLong, got {:?}", other.map(|_| ())),
    }
    gate.set_open(true);
    assert!(answer(running).is_ok());
    for t in queued {
        assert!(answer(t).is_ok());
    }
    router.shutdown();
}

#[test]
fn the_default_budget_is_a_number_of_measured_service_times() {
    let gate = Gate::closed();
    let router = start(
        vec![gated("slow", 1, OFF, &gate)],
        // By count, as the fixed budget's test: by cost what is left of the running
        // request shrinks as it runs (tested with the cost estimate above).
        SchedulerConfig {
            queue_capacity: 16,
            max_queue_wait: QueueBudget::ServiceTimes(2.5),
            scheduling: Scheduling::Count,
            ..SchedulerConfig::default()
        },
    );
    // Before a service time is measured there is no budget: admission by count.
    let first = router.submit(0, far()).expect("admitted");
    // 100 ms a request on one replica: a budget of 250 ms, as in the fixed test above.
    router.seed_service_time(0, Duration::from_millis(100));
    let mut held = vec![first];
    held.extend((1..3).map(|id| router.submit(id, far()).expect("admitted")));
    match router.submit(3, far()) {
        Err(SubmitError::WaitTooLong {
            estimated_ms: 300,
            budget_ms: 250,
            ..
        }) => {}
        other => panic!("expected WaitTooLong, got {:?}", other.map(|_| ())),
    }
    gate.set_open(true);
    for t in held {
        assert!(answer(t).is_ok());
    }
    router.shutdown();
}

#[test]
fn a_full_server_says_when_a_slot_is_expected_free() {
    let gate = Gate::closed();
    let router = start(
        vec![gated("slow", 2, OFF, &gate)],
        SchedulerConfig {
            queue_capacity: 16,
            max_in_flight: Some(4),
            ..SchedulerConfig::default()
        },
    );
    router.seed_service_time(0, Duration::from_millis(400));
    let held: Vec<_> = (0..4)
        .map(|id| router.submit(id, far()).expect("admitted"))
        .collect();
    // Two replicas at 400 ms: 5 requests a second; one must finish to free a slot.
    match router.submit(4, far()) {
        Err(SubmitError::Overloaded {
            capacity: 4,
            retry_after_ms: 200,
        }) => {}
        other => panic!("expected Overloaded, got {:?}", other.map(|_| ())),
    }
    gate.set_open(true);
    for t in held {
        assert!(answer(t).is_ok());
    }
    router.shutdown();
}

#[test]
fn expired_requests_are_dropped_before_they_run() {
    let gate = Gate::closed();
    let router = start(
        vec![gated("only", 1, OFF, &gate)],
        SchedulerConfig::default(),
    );
    // Priced at next to nothing, so that the expiring request is admitted: it would
    // finish in time, had it not to wait for the run the gate holds.
    router.seed_service_time(0, Duration::from_nanos(1));
    let running = router.submit(0, far()).expect("admitted");
    gate.wait_entered(1);
    let expiring = router
        .submit(1, Instant::now() + Duration::from_millis(30))
        .expect("admitted");
    let after = router.submit(2, far()).expect("admitted");
    assert!(matches!(answer(expiring), Err(JobError::DeadlineExceeded)));

    gate.set_open(true);
    assert!(answer(running).is_ok());
    assert_eq!(answer(after).expect("served").output, 2);
    assert_eq!(gate.ran(), [vec![0], vec![2]]);
    router.shutdown();
}

#[test]
fn requests_whose_client_left_are_not_run() {
    let gate = Gate::closed();
    let router = start(
        vec![gated("only", 1, OFF, &gate)],
        SchedulerConfig::default(),
    );
    let running = router.submit(0, far()).expect("admitted");
    gate.wait_entered(1);
    let abandoned = router.submit(1, far()).expect("admitted");
    let after = router.submit(2, far()).expect("admitted");
    drop(abandoned);

    gate.set_open(true);
    assert!(answer(running).is_ok());
    assert!(answer(after).is_ok());
    assert_eq!(gate.ran(), [vec![0], vec![2]]);
    let cancelled = router
        .metrics()
        .cancelled
        .get_or_create(&DeviceLabel {
            device: "only".into(),
        })
        .get();
    assert_eq!(cancelled, 1);
    router.shutdown();
}

#[test]
fn batches_form_under_load_and_not_when_idle() {
    let gate = Gate::open();
    let batching = BatchingSpec {
        max_batch: 4,
        max_wait_us: 2_000,
    };
    let router = start(
        vec![gated("batched", 1, batching, &gate)],
        SchedulerConfig::default(),
    );

    // Idle: a lone request runs alone, at once.
    let done = answer(router.submit(0, far()).expect("admitted")).expect("served");
    assert_eq!(done.batch_size, 1);

    // Under load: five wait behind a running one; four go in one run, then the last.
    gate.set_open(false);
    let running = router.submit(1, far()).expect("admitted");
    gate.wait_entered(2);
    let waiting: Vec<_> = (2..7)
        .map(|id| router.submit(id, far()).expect("admitted"))
        .collect();
    gate.set_open(true);
    assert_eq!(answer(running).expect("served").batch_size, 1);
    let sizes: Vec<usize> = waiting
        .into_iter()
        .map(|t| answer(t).expect("served").batch_size)
        .collect();
    assert_eq!(sizes, [4, 4, 4, 4, 1]);
    assert_eq!(gate.ran(), [vec![0], vec![1], vec![2, 3, 4, 5], vec![6]]);
    router.shutdown();
}

#[test]
fn with_no_healthy_device_requests_are_refused() {
    let gate = Gate::open();
    gate.set_failing(true);
    let router = start(
        vec![gated("only", 1, OFF, &gate)],
        SchedulerConfig {
            unhealthy_after_failures: 1,
            health_check_interval: Duration::from_secs(600),
            ..SchedulerConfig::default()
        },
    );
    // The request whose run failed gets that failure (the server's error) or, when the
    // device was marked unhealthy first, the refusal its retry met; the next one is
    // refused at once.
    let error = answer(router.submit(0, far()).expect("admitted")).expect_err("failed");
    assert!(
        matches!(
            error,
            JobError::Failed { .. } | JobError::Rejected(SubmitError::NoHealthyDevice)
        ),
        "{error}"
    );
    assert!(matches!(
        router.submit(1, far()),
        Err(SubmitError::NoHealthyDevice)
    ));
    router.shutdown();
}

#[test]
fn simulated_devices_run_through_the_same_router() {
    let (setups, controls) = sim_devices(
        &[1.0, 0.5],
        ServiceTime {
            median: Duration::from_micros(200),
            sigma: 0.2,
        },
        Duration::ZERO,
        1,
        BatchingSpec::OFF,
        0.0,
        3,
    );
    let router = Arc::new(Scheduler::start(
        setups,
        SchedulerConfig {
            queue_capacity: 512,
            ..SchedulerConfig::default()
        },
    ));
    router.wait_ready().expect("simulated devices load");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let report = drive(
        &router,
        &runtime,
        &LoadSpec {
            arrivals: Arrivals::Poisson { rate_per_s: 1000.0 },
            requests: 300,
            sizes: SizeClass::uniform(Duration::from_secs(600)),
            seed: 5,
        },
    );
    assert_eq!(
        (report.completed, report.rejected, report.failed),
        (300, 0, 0)
    );
    let runs: usize = controls
        .iter()
        .map(|c| c.runs.load(std::sync::atomic::Ordering::Relaxed))
        .sum();
    assert_eq!(runs, 300);
    router.shutdown();
}

/// A device of one gated replica that loads only when the test sends on the channel.
fn loads_when_told(
    name: &str,
    gate: &Arc<Gate>,
) -> (
    celer::sched::DeviceSetup<GateExecutor>,
    std::sync::mpsc::Sender<()>,
) {
    let (loaded_tx, loaded_rx) = std::sync::mpsc::channel::<()>();
    let loaded_rx = std::sync::Mutex::new(loaded_rx);
    let gate = gate.clone();
    let setup = celer::sched::DeviceSetup {
        name: name.into(),
        replicas: 1,
        batching: OFF,
        load: Arc::new(move |_| {
            let _ = loaded_rx.lock().unwrap().recv();
            Ok(GateExecutor(gate.clone()))
        }),
        interim: false,
    };
    (setup, loaded_tx)
}

/// A device is full by what it holds (running and queued), not by its channel's length:
/// requests placed before an idle replica has taken the last one (here: before it has
/// even loaded) fill its replicas' places and then its queue's, and only then are refused.
#[test]
fn requests_placed_before_an_idle_replica_wakes_are_not_refused() {
    let gate = Gate::open();
    let (slow_load, loaded_tx) = loads_when_told("only", &gate);
    let router = Scheduler::start(
        vec![slow_load],
        SchedulerConfig {
            queue_capacity: 1,
            ..SchedulerConfig::default()
        },
    );
    // One replica, one queue place: two requests held, the third refused.
    let held: Vec<_> = (0..2)
        .map(|id| router.submit(id, far()).expect("admitted and placed"))
        .collect();
    assert!(matches!(
        router.submit(2, far()),
        Err(SubmitError::Overloaded { .. })
    ));
    loaded_tx.send(()).unwrap();
    for t in held {
        assert!(answer(t).is_ok());
    }
    router.shutdown();
}

/// An interim device (the CPU while the GPUs' engines build) takes the requests while the
/// device that stays loads; readiness says so without waiting for it. Once the other has
/// loaded, the interim one takes no new request: what it holds it finishes, the next go
/// to the device that stays, and readiness is whole.
#[test]
fn an_interim_device_serves_until_the_lasting_one_loads_then_retires() {
    use celer::sched::Readiness;
    let (interim_gate, lasting_gate) = (Gate::open(), Gate::open());
    let (lasting, loaded_tx) = loads_when_told("gpu0", &lasting_gate);
    let interim = celer::sched::DeviceSetup {
        interim: true,
        ..gated("cpu", 1, OFF, &interim_gate)
    };
    let router = Scheduler::start(vec![lasting, interim], SchedulerConfig::default());
    eventually("the interim device serves", || {
        router.readiness() == Readiness::Interim { loaded: 0, of: 1 }
    });
    // The device still loading gets none of them, though it is idle.
    for id in 0..4 {
        let ticket = router.submit(id, far()).expect("admitted");
        assert_eq!(ticket.device(), Some(1), "request {id}");
        assert_eq!(answer(ticket).expect("answered").device, 1);
    }
    // One held on the interim device across the switch.
    interim_gate.set_open(false);
    let held = router.submit(10, far()).expect("admitted");
    assert_eq!(held.device(), Some(1));
    interim_gate.wait_entered(5);
    let held = answer_later(held);

    loaded_tx.send(()).unwrap();
    eventually("the interim device retires", || {
        router.readiness() == Readiness::Ready && !router.devices()[1].healthy
    });
    for id in 20..23 {
        let ticket = router.submit(id, far()).expect("admitted");
        assert_eq!(ticket.device(), Some(0), "request {id}");
        assert_eq!(answer(ticket).expect("answered").device, 0);
    }
    interim_gate.set_open(true);
    let held = held.join().unwrap().expect("the held request is answered");
    assert_eq!(held.device, 1, "finished where it was");
    assert_eq!(lasting_gate.ran().len(), 3);
    router.shutdown();
}

/// Work priced by the prior (placed before the first run was measured) is a guess, and a
/// guess refuses nothing: with such work queued and running, the wait that admission
/// weighs against its budget is counted in measured service times, not in the prior's
/// prices (here, of seconds for each 50-megapixel request).
#[test]
fn a_queue_budget_is_not_spent_on_the_priors_guess() {
    use celer::sched::{Terms, Work};
    let gate = Gate::closed();
    let router = start(
        vec![gated("only", 1, OFF, &gate)],
        SchedulerConfig {
            queue_capacity: 8,
            max_queue_wait: QueueBudget::ServiceTimes(100.0),
            ..SchedulerConfig::default()
        },
    );
    let large = Work {
        pixels: 50_000_000,
        composite: false,
    };
    let submit_large = |id: u32| {
        let admission = router.admit().expect("admitted");
        router
            .submit_admitted(admission, id, Terms::by(far()).with_work(large))
            .expect("placed")
    };
    // Three priced by the prior: one runs, two wait.
    let tickets: Vec<_> = (0..3).map(submit_large).collect();
    gate.wait_entered(1);
    // The first ends (quickly): a service time is measured, while a guessed run and a
    // guessed queued job remain.
    gate.allow(1);
    gate.wait_entered(2);
    assert!(
        router.estimated_wait().is_some(),
        "a service time is measured"
    );
    // Two service times ahead, within the budget of 100.
    assert!(
        router.check_admission().is_ok(),
        "{:?}",
        router.check_admission()
    );
    gate.set_open(true);
    for t in tickets {
        assert!(answer(t).is_ok());
    }
    router.shutdown();
}

/// The time a request's answer takes after its run (`Terms::answer`, its encode) is the
/// request's too: by cost, a request whose run would end in time but whose answer would
/// not is refused at once, and the expected completion it is told counts the answer; by
/// count nothing is refused for its price.
#[test]
fn the_answers_time_after_the_run_is_kept_off_the_deadline() {
    use celer::sched::Terms;
    let gate = Gate::closed();
    let start_with = |scheduling| {
        let router = start(
            vec![gated("only", 1, OFF, &gate)],
            SchedulerConfig {
                queue_capacity: 8,
                scheduling,
                ..SchedulerConfig::default()
            },
        );
        // Prices of 100 s, so that the milliseconds this test takes are lost in them.
        router.seed_service_time(0, Duration::from_secs(100));
        router
    };
    let within = |s: u64| Terms::by(Instant::now() + Duration::from_secs(s));
    let router = start_with(Scheduling::Cost);
    // A 100 s run and a 50 s answer do not end within 120 s...
    let terms = within(120).with_answer(Duration::from_secs(50));
    match router.submit_admitted(router.admit().expect("a slot"), 0, terms) {
        Err(SubmitError::DeadlineUnreachable {
            expected_ms,
            deadline_ms,
            ..
        }) => {
            assert_eq!(expected_ms, 150_000);
            assert!((119_000..=120_000).contains(&deadline_ms), "{deadline_ms}");
        }
        other => panic!("expected DeadlineUnreachable, got {:?}", other.map(|_| ())),
    }
    // With no time for the answer, 120 s is enough; behind that run (100 s), a run and
    // an answer end within 260 s.
    let admitted = [
        within(120),
        within(260).with_answer(Duration::from_secs(50)),
    ]
    .map(|terms| {
        router
            .submit_admitted(router.admit().expect("a slot"), 1, terms)
            .expect("admitted")
    });
    gate.set_open(true);
    for t in admitted {
        assert!(answer(t).is_ok());
    }
    router.shutdown();

    gate.set_open(false);
    let router = start_with(Scheduling::Count);
    let terms = within(120).with_answer(Duration::from_secs(50));
    let ticket = router
        .submit_admitted(router.admit().expect("a slot"), 2, terms)
        .expect("by count, admitted");
    gate.set_open(true);
    assert!(answer(ticket).is_ok());
    router.shutdown();
}

/// Prices change only with runs, so a device whose prices refuse every request would
/// refuse them for good. Once it has run nothing for `reprobe_after`, one request they
/// refuse goes to it anyway, alone; run faster than its price, it restarts the prices.
#[test]
fn a_device_refusing_on_prices_no_run_has_tested_for_a_while_probes_them() {
    let gate = Gate::closed();
    let reprobe_after = Duration::from_secs(2);
    let router = start(
        vec![gated("only", 1, OFF, &gate)],
        SchedulerConfig {
            reprobe_after,
            ..SchedulerConfig::default()
        },
    );
    // Priced at 100 s, then a run of a moment: still priced at tens of seconds.
    router.seed_service_time(0, Duration::from_secs(100));
    let first = router.submit(0, far()).expect("admitted");
    gate.allow(1);
    assert!(answer(first).is_ok());
    let within_a_second = || Instant::now() + Duration::from_secs(1);
    let refused = |result: Result<Ticket<GateExecutor>, SubmitError>| {
        matches!(result, Err(SubmitError::DeadlineUnreachable { .. }))
    };
    // A run just ended: its prices stand.
    assert!(refused(router.submit(1, within_a_second())));
    std::thread::sleep(reprobe_after + Duration::from_millis(100));
    // Nothing ran since: one request is sent as a probe, and only one. The check made
    // before a request is decoded lets it through without taking the probe from it.
    let terms = celer::sched::Terms::by(within_a_second());
    assert!(router.check_deadline(&terms).is_ok());
    assert!(router.check_deadline(&terms).is_ok());
    let probe = router
        .submit_admitted(router.admit().expect("a slot"), 2, terms)
        .expect("a probe");
    gate.wait_entered(2);
    assert!(refused(router.submit(3, within_a_second())));
    gate.allow(1);
    assert!(answer(probe).is_ok());
    // It ran in a moment: the device is priced by it now.
    let after = router.submit(4, within_a_second()).expect("admitted");
    gate.allow(1);
    assert!(answer(after).is_ok());
    assert_eq!(gate.ran(), vec![vec![0], vec![2], vec![4]]);
    router.shutdown();
}

/// A device that cannot finish a request by its deadline refuses it for itself, not for
/// the others: least busy by cost offers it to the next device by expected completion,
/// and refuses it only when none can, with the figures of the one that would have
/// finished it first.
#[test]
fn a_request_one_device_cannot_finish_in_time_goes_to_one_that_can() {
    let (fast, slow) = (Gate::closed(), Gate::closed());
    let router = start(
        vec![gated("fast", 1, OFF, &fast), gated("slow", 1, OFF, &slow)],
        SchedulerConfig::default(),
    );
    router.seed_service_time(0, Duration::from_millis(1));
    router.seed_service_time(1, Duration::from_secs(2));
    // A run priced at 1 ms held for at least 200: fast's margin (its newest runs' time
    // over their price) is at least 200 from then on, its prices seeded again.
    let held = router.submit(0, far()).expect("admitted");
    assert_eq!(held.device(), Some(0));
    fast.wait_entered(1);
    std::thread::sleep(Duration::from_millis(200));
    fast.allow(1);
    assert!(answer(held).is_ok());
    router.seed_service_time(0, Duration::from_secs(1));
    assert!(router.devices()[0].overrun >= 200.0);

    // Fast would finish it first by its prices (1 s against 2), but not by its margin
    // (200 s and more): slow, which would, takes it.
    let within = |s: u64| Instant::now() + Duration::from_secs(s);
    let ticket = router.submit(1, within(60)).expect("admitted on slow");
    assert_eq!(ticket.device(), Some(1));
    // Neither can in a second and a half: refused, with what fast would have taken.
    match router.submit(2, Instant::now() + Duration::from_millis(1500)) {
        Err(SubmitError::DeadlineUnreachable { expected_ms, .. }) => {
            assert!(expected_ms >= 200_000, "{expected_ms}");
        }
        other => panic!("expected DeadlineUnreachable, got {:?}", other.map(|_| ())),
    }
    slow.allow(1);
    assert!(answer(ticket).is_ok());
    assert_eq!(fast.ran(), vec![vec![0]]);
    assert_eq!(slow.ran(), vec![vec![1]]);
    router.shutdown();
}

//! Test executors whose runs the test decides: each run waits at a `Gate` until the test
//! lets it through, then succeeds or fails as the gate says, and the gate records what
//! ran. They make router tests deterministic: no result depends on how long anything
//! takes, only on the order the test imposes.

#![allow(dead_code)]

use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use celer::sched::{DeviceSetup, ExecError, Executor};
use celer::spec::BatchingSpec;

/// Far beyond anything a passing test needs; a test that waits this long has failed.
pub const PATIENCE: Duration = Duration::from_secs(20);

#[derive(Default)]
struct GateState {
    open: bool,
    permits: usize,
    failing: bool,
    /// Runs that have started (and may be waiting).
    entered: usize,
    /// The inputs of each run let through, in order.
    ran: Vec<Vec<u32>>,
    health_checks: usize,
}

#[derive(Default)]
pub struct Gate {
    state: Mutex<GateState>,
    changed: Condvar,
}

impl Gate {
    pub fn closed() -> Arc<Self> {
        Arc::new(Self::default())
    }

    pub fn open() -> Arc<Self> {
        let gate = Self::closed();
        gate.set_open(true);
        gate
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn set_open(&self, open: bool) {
        self.lock().open = open;
        self.changed.notify_all();
    }

    /// Lets `n` more runs through a closed gate.
    pub fn allow(&self, n: usize) {
        self.lock().permits += n;
        self.changed.notify_all();
    }

    pub fn set_failing(&self, failing: bool) {
        self.lock().failing = failing;
        self.changed.notify_all();
    }

    pub fn ran(&self) -> Vec<Vec<u32>> {
        self.lock().ran.clone()
    }

    pub fn health_checks(&self) -> usize {
        self.lock().health_checks
    }

    /// Blocks until `n` runs have started.
    pub fn wait_entered(&self, n: usize) {
        let deadline = Instant::now() + PATIENCE;
        let mut state = self.lock();
        while state.entered < n {
            assert!(
                Instant::now() < deadline,
                "only {} runs started, expected {n}",
                state.entered
            );
            state = self
                .changed
                .wait_timeout(state, Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Enter, wait to be let through, record; `Err` while failing.
    pub fn pass(&self, ids: Vec<u32>) -> Result<(), ExecError> {
        let deadline = Instant::now() + PATIENCE;
        let mut state = self.lock();
        state.entered += 1;
        self.changed.notify_all();
        while !state.open && state.permits == 0 {
            if Instant::now() > deadline {
                return Err("the test never opened the gate".into());
            }
            state = self
                .changed
                .wait_timeout(state, Duration::from_millis(50))
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        if !state.open {
            state.permits -= 1;
        }
        state.ran.push(ids);
        if state.failing {
            Err("the gate says fail".into())
        } else {
            Ok(())
        }
    }

    fn health_check(&self) -> Result<(), ExecError> {
        let mut state = self.lock();
        state.health_checks += 1;
        if state.failing {
            Err("the gate says fail".into())
        } else {
            Ok(())
        }
    }
}

/// Runs request ids through a gate and answers with them.
pub struct GateExecutor(pub Arc<Gate>);

impl Executor for GateExecutor {
    type Input = u32;
    type Output = u32;

    fn run_batch(&mut self, inputs: &[&u32]) -> Result<Vec<u32>, ExecError> {
        let ids: Vec<u32> = inputs.iter().map(|&&i| i).collect();
        self.0.pass(ids.clone())?;
        Ok(ids)
    }

    fn health_check(&mut self) -> Result<(), ExecError> {
        self.0.health_check()
    }
}

/// A device named `name` whose `replicas` all pass through `gate`.
pub fn gated(
    name: &str,
    replicas: usize,
    batching: BatchingSpec,
    gate: &Arc<Gate>,
) -> DeviceSetup<GateExecutor> {
    let gate = gate.clone();
    DeviceSetup {
        name: name.into(),
        replicas,
        batching,
        load: Arc::new(move |_| Ok(GateExecutor(gate.clone()))),
        interim: false,
    }
}

/// Polls `condition` until it holds; panics after `PATIENCE`.
pub fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !condition() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

//! How the replicas of one CPU device share its cores. Each replica has sessions with its
//! share of the threads (cores / replicas), so that concurrent requests never
//! oversubscribe the cores; one more set of sessions, with a thread per core, is lent to a
//! replica while it is the only one running, so that a lone request's model runs use
//! every core. The choice is made per run, so parallelism follows the load.
//!
//! Why this layout: a session with every core's thread runs a lone model faster than one
//! with its share, but under load sessions of a share each, running together, do more
//! work than one session of every core, and more than sessions on ONNX Runtime's shared
//! pool (`celer bench local --model-only`; figures in docs/decisions.md, "CPU threads:
//! replicas and a solo set").

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, TryLockError};

/// The count of a device's running replicas and the solo set `S` they may borrow.
pub struct CoreShare<S> {
    running: AtomicUsize,
    solo: Option<Mutex<S>>,
    lent: AtomicU64,
}

impl<S> CoreShare<S> {
    /// `solo`: the sessions with a thread per core, if any (none on one core, or when the
    /// replicas' own sessions already have every core).
    pub fn new(solo: Option<S>) -> Self {
        Self {
            running: AtomicUsize::new(0),
            solo: solo.map(Mutex::new),
            lent: AtomicU64::new(0),
        }
    }

    pub fn has_solo(&self) -> bool {
        self.solo.is_some()
    }

    /// How many times the solo set was lent.
    pub fn solo_runs(&self) -> u64 {
        self.lent.load(Ordering::Relaxed)
    }

    /// Counts the caller as running until the guard drops (also when it unwinds).
    pub fn enter(&self) -> Running<'_> {
        self.running.fetch_add(1, Ordering::AcqRel);
        Running(&self.running)
    }

    /// The solo set, when the caller (who has `enter`ed) is the only replica running,
    /// no request is `waiting` for the device, and nobody holds the set. Otherwise the
    /// caller runs on its own share of the cores. (Under load a replica may find itself
    /// alone for a moment, between another's runs, but never with an empty queue: the
    /// queue is what keeps a busy device from going solo and oversubscribing the cores.)
    pub fn lend_solo(&self, _running: &Running<'_>, waiting: usize) -> Option<MutexGuard<'_, S>> {
        if waiting > 0 || self.running.load(Ordering::Acquire) != 1 {
            return None;
        }
        let solo = match self.solo.as_ref()?.try_lock() {
            Ok(solo) => solo,
            // A panic in a solo run (caught and its replica replaced, see `sched`) left
            // ONNX Runtime's sessions as they were: the set stays usable.
            Err(TryLockError::Poisoned(poisoned)) => poisoned.into_inner(),
            Err(TryLockError::WouldBlock) => return None,
        };
        self.lent.fetch_add(1, Ordering::Relaxed);
        Some(solo)
    }
}

/// A running replica, counted until dropped.
pub struct Running<'a>(&'a AtomicUsize);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lone_replica_borrows_the_solo_set_and_a_busy_device_does_not() {
        let share = CoreShare::new(Some(7u32));
        let first = share.enter();
        assert_eq!(share.lend_solo(&first, 0).as_deref(), Some(&7));
        let second = share.enter();
        assert!(
            share.lend_solo(&first, 0).is_none(),
            "two running: own shares"
        );
        assert!(share.lend_solo(&second, 0).is_none());
        drop(first);
        assert_eq!(share.lend_solo(&second, 0).as_deref(), Some(&7));
        assert_eq!(share.solo_runs(), 2);
    }

    #[test]
    fn a_replica_alone_with_requests_waiting_keeps_to_its_share() {
        let share = CoreShare::new(Some(()));
        let running = share.enter();
        assert!(share.lend_solo(&running, 1).is_none());
        assert!(share.lend_solo(&running, 0).is_some());
    }

    #[test]
    fn the_solo_set_has_one_borrower_at_a_time() {
        let share = CoreShare::new(Some(()));
        let running = share.enter();
        let held = share.lend_solo(&running, 0);
        assert!(held.is_some());
        assert!(share.lend_solo(&running, 0).is_none());
        drop(held);
        assert!(share.lend_solo(&running, 0).is_some());
    }

    #[test]
    fn without_a_solo_set_nothing_is_lent() {
        let share: CoreShare<()> = CoreShare::new(None);
        let running = share.enter();
        assert!(share.lend_solo(&running, 0).is_none());
        assert!(!share.has_solo());
    }

    #[test]
    fn a_replica_that_unwinds_stops_counting() {
        let share = CoreShare::new(Some(()));
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _running = share.enter();
            panic!("a stage panicked");
        }));
        assert!(caught.is_err());
        let running = share.enter();
        assert!(share.lend_solo(&running, 0).is_some());
    }
}

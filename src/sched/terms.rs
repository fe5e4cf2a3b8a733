//! What a request asks of the scheduler besides its input: its deadline, its priority
//! (the client's, Triton's order: 1 runs first) and its work, which the cost model prices
//! on each device. The HTTP and gRPC layers read them from the client's headers and
//! parameters; here they are only values.

use std::fmt;
use std::time::{Duration, Instant};

use super::cost::Work;

/// How urgent a request is among those on its device: a level from 1 (runs first) to
/// `Priority::LOWEST`, as Triton numbers its priority levels; 0, or none given, is the
/// default level, in the middle, so that a client can ask for more or less than others.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Priority(u8);

impl Priority {
    pub const HIGHEST: Priority = Priority(1);
    pub const DEFAULT: Priority = Priority(5);
    pub const LOWEST: Priority = Priority(9);

    /// A client's level: 0 is the default, 1 to 9 are levels, anything else is refused.
    pub fn from_level(level: u64) -> Result<Self, PriorityError> {
        match level {
            0 => Ok(Self::DEFAULT),
            1..=9 => Ok(Self(level as u8)),
            _ => Err(PriorityError(level.to_string())),
        }
    }

    pub fn level(self) -> u8 {
        self.0
    }
}

impl Default for Priority {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl fmt::Display for Priority {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl std::str::FromStr for Priority {
    type Err = PriorityError;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let level = text
            .trim()
            .parse::<u64>()
            .map_err(|_| PriorityError(text.to_string()))?;
        Self::from_level(level)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("priority `{0}`: expected a level from 1 (runs first) to 9, or 0 for the default (5)")]
pub struct PriorityError(String);

/// A request's terms: when its answer is no longer wanted, how urgent it is, its work,
/// and how long its answer takes to make once its run has ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Terms {
    pub deadline: Instant,
    /// What the answer is expected to take after the run, at worst (its encode, on the
    /// server's blocking pool): the run must end this much before `deadline`, or the
    /// answer is late though the run was in time.
    pub answer: Duration,
    /// The server's own deadline, no sooner than `deadline`: a run past it is a stuck
    /// device's sign (a run past only the client's is a late answer, not a fault).
    pub server_deadline: Instant,
    pub priority: Priority,
    pub work: Work,
}

impl Terms {
    /// A request of no particular size at the default priority.
    pub fn by(deadline: Instant) -> Self {
        Self {
            deadline,
            answer: Duration::ZERO,
            server_deadline: deadline,
            priority: Priority::DEFAULT,
            work: Work::default(),
        }
    }

    /// The terms with the server's deadline `server` (kept no sooner than `deadline`).
    pub fn with_server_deadline(self, server: Instant) -> Self {
        Self {
            server_deadline: server.max(self.deadline),
            ..self
        }
    }

    /// The terms with `answer` kept for the answer after the run (`Terms::answer`).
    pub fn with_answer(self, answer: Duration) -> Self {
        Self { answer, ..self }
    }

    /// When the run must end for the answer to be in time: the deadline the scheduler
    /// admits, orders and refuses by.
    pub fn run_deadline(&self) -> Instant {
        self.deadline
            .checked_sub(self.answer)
            .unwrap_or(self.deadline)
    }

    pub fn with_work(self, work: Work) -> Self {
        Self { work, ..self }
    }

    pub fn with_priority(self, priority: Priority) -> Self {
        Self { priority, ..self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn levels_are_tritons_with_a_middle_default() {
        assert_eq!("1".parse(), Ok(Priority::HIGHEST));
        assert_eq!("0".parse(), Ok(Priority::DEFAULT));
        assert_eq!("9".parse(), Ok(Priority::LOWEST));
        assert!(Priority::HIGHEST < Priority::DEFAULT);
        for wrong in ["10", "-1", "high", ""] {
            assert!(wrong.parse::<Priority>().is_err(), "{wrong}");
        }
    }
}

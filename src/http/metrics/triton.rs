//! Triton's inference metrics under Triton's own names, types, labels and units, so that
//! a dashboard or alert written for Triton reads celer unchanged: cumulative counters
//! (`nv_inference_*_duration_us` are counters of microseconds, not histograms) labelled
//! `model` and `version`, and `nv_inference_request_failure` by Triton's `reason`.
//! celer's histograms by device stay beside them under `celer_`.
//!
//! What each stage means here: `compute_input` is the preprocessing (resize, normalise,
//! upload), `compute_infer` the model, `compute_output` trimap, matting and compositing;
//! a request's duration is its whole HTTP exchange, decode and encode included.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::exposition::{Exposition, Kind};
use crate::matte::StageTimings;

/// Triton's `version` label: celer serves one version of its model.
pub const VERSION: &str = "1";

/// Why an inference request failed, as Triton's `reason` label says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Refused at admission: overload, the queue wait budget, no healthy device (503).
    Rejected,
    /// The client went away while its request was queued.
    Canceled,
    /// The model or device failed (5xx other than 503).
    Backend,
    /// The request itself was wrong (4xx).
    Other,
}

impl Failure {
    const ALL: [Failure; 4] = [
        Failure::Rejected,
        Failure::Canceled,
        Failure::Backend,
        Failure::Other,
    ];

    /// Where `TritonTotals` counts it; `None`: the scheduler counts it (cancellations
    /// happen in a queue, with no response to see).
    fn slot(self) -> Option<usize> {
        match self {
            Failure::Rejected => Some(0),
            Failure::Backend => Some(1),
            Failure::Other => Some(2),
            Failure::Canceled => None,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Failure::Rejected => "REJECTED",
            Failure::Canceled => "CANCELED",
            Failure::Backend => "BACKEND",
            Failure::Other => "OTHER",
        }
    }
}

/// The running totals behind Triton's families, added to on each inference request's
/// end. Atomics: the request path never takes a lock for them.
#[derive(Default)]
pub struct TritonTotals {
    success: AtomicU64,
    failure: [AtomicU64; 3],
    request_us: AtomicU64,
    queue_us: AtomicU64,
    compute_input_us: AtomicU64,
    compute_infer_us: AtomicU64,
    compute_output_us: AtomicU64,
}

/// What the scheduler knows that the HTTP layer does not, read at scrape time.
pub struct SchedulerTotals {
    /// Model runs (batches), summed over devices.
    pub executions: u64,
    /// Requests skipped in a queue because their client had gone.
    pub canceled: u64,
    /// Requests queued now.
    pub pending: u64,
}

fn us(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

impl TritonTotals {
    /// A request answered with the model's result: `took` end to end, `queued` before a
    /// replica took it, `stages` as the replica and the codecs timed them.
    pub fn success(&self, took: Duration, queued: Duration, stages: &StageTimings) {
        self.success.fetch_add(1, Ordering::Relaxed);
        self.request_us.fetch_add(us(took), Ordering::Relaxed);
        self.queue_us.fetch_add(us(queued), Ordering::Relaxed);
        self.compute_input_us
            .fetch_add(us(stages.preprocess), Ordering::Relaxed);
        self.compute_infer_us
            .fetch_add(us(stages.model), Ordering::Relaxed);
        let output = stages.trimap + stages.matting + stages.composite;
        self.compute_output_us
            .fetch_add(us(output), Ordering::Relaxed);
    }

    /// A request that ended without a result (cancellations are the scheduler's count).
    pub fn failure(&self, why: Failure, took: Duration) {
        let Some(slot) = why.slot() else {
            return;
        };
        self.failure[slot].fetch_add(1, Ordering::Relaxed);
        self.request_us.fetch_add(us(took), Ordering::Relaxed);
    }

    fn failures(&self, why: Failure, sched: &SchedulerTotals) -> u64 {
        why.slot().map_or(sched.canceled, |slot| {
            self.failure[slot].load(Ordering::Relaxed)
        })
    }

    /// Triton's families for `model`.
    pub fn write(&self, e: &mut Exposition, model: &str, sched: &SchedulerTotals) {
        let labels = [("model", model), ("version", VERSION)];
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        let counter = |e: &mut Exposition, name: &str, help: &str, value: f64| {
            e.family(name, help, Kind::Counter, [(&labels[..], value)]);
        };
        let success = load(&self.success);
        counter(
            e,
            "nv_inference_request_success",
            "Number of successful inference requests, all batch sizes",
            success,
        );
        let reasons: Vec<([(&str, &str); 3], f64)> = Failure::ALL
            .iter()
            .map(|&why| {
                (
                    [
                        ("model", model),
                        ("reason", why.label()),
                        ("version", VERSION),
                    ],
                    self.failures(why, sched) as f64,
                )
            })
            .collect();
        e.family(
            "nv_inference_request_failure",
            "Number of failed inference requests, all batch sizes",
            Kind::Counter,
            reasons.iter().map(|(l, v)| (&l[..], *v)),
        );
        // One image per request: an inference is a request that succeeded.
        counter(
            e,
            "nv_inference_count",
            "Number of inferences performed (does not include cached requests)",
            success,
        );
        counter(
            e,
            "nv_inference_exec_count",
            "Number of model executions performed (does not include cached requests)",
            sched.executions as f64,
        );
        counter(
            e,
            "nv_inference_request_duration_us",
            "Cumulative inference request duration in microseconds (includes cached requests)",
            load(&self.request_us),
        );
        counter(
            e,
            "nv_inference_queue_duration_us",
            "Cumulative inference queuing duration in microseconds (includes cached requests)",
            load(&self.queue_us),
        );
        counter(
            e,
            "nv_inference_compute_input_duration_us",
            "Cumulative compute input duration in microseconds (does not include cached requests)",
            load(&self.compute_input_us),
        );
        counter(
            e,
            "nv_inference_compute_infer_duration_us",
            "Cumulative compute inference duration in microseconds (does not include cached requests)",
            load(&self.compute_infer_us),
        );
        counter(
            e,
            "nv_inference_compute_output_duration_us",
            "Cumulative inference compute output duration in microseconds (does not include cached requests)",
            load(&self.compute_output_us),
        );
        e.family(
            "nv_inference_pending_request_count",
            "Instantaneous number of pending requests awaiting execution per-model.",
            Kind::Gauge,
            [(&labels[..], sched.pending as f64)],
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_add_up_by_stage_and_reason() {
        let t = TritonTotals::default();
        let ms = Duration::from_millis;
        let stages = StageTimings {
            preprocess: ms(2),
            model: ms(10),
            trimap: ms(1),
            matting: ms(3),
            composite: ms(1),
            ..StageTimings::default()
        };
        t.success(ms(30), ms(4), &stages);
        t.success(ms(20), ms(0), &stages);
        t.failure(Failure::Rejected, ms(1));
        t.failure(Failure::Other, ms(2));
        let sched = SchedulerTotals {
            executions: 2,
            canceled: 5,
            pending: 1,
        };
        let mut e = Exposition::default();
        t.write(&mut e, "u2netp", &sched);
        let text = e.finish();
        let m = "model=\"u2netp\",version=\"1\"";
        for line in [
            format!("nv_inference_request_success{{{m}}} 2"),
            format!("nv_inference_count{{{m}}} 2"),
            format!("nv_inference_exec_count{{{m}}} 2"),
            format!("nv_inference_request_duration_us{{{m}}} 53000"),
            format!("nv_inference_queue_duration_us{{{m}}} 4000"),
            format!("nv_inference_compute_input_duration_us{{{m}}} 4000"),
            format!("nv_inference_compute_infer_duration_us{{{m}}} 20000"),
            format!("nv_inference_compute_output_duration_us{{{m}}} 10000"),
            format!("nv_inference_pending_request_count{{{m}}} 1"),
            "nv_inference_request_failure{model=\"u2netp\",reason=\"REJECTED\",version=\"1\"} 1"
                .into(),
            "nv_inference_request_failure{model=\"u2netp\",reason=\"CANCELED\",version=\"1\"} 5"
                .into(),
            "nv_inference_request_failure{model=\"u2netp\",reason=\"BACKEND\",version=\"1\"} 0"
                .into(),
            "nv_inference_request_failure{model=\"u2netp\",reason=\"OTHER\",version=\"1\"} 1"
                .into(),
            "# TYPE nv_inference_request_duration_us counter".into(),
            "# TYPE nv_inference_pending_request_count gauge".into(),
        ] {
            assert!(text.lines().any(|l| l == line), "no `{line}` in\n{text}");
        }
    }
}

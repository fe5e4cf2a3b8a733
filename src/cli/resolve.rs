//! `celer serve`'s one resolution: the flags, the hosting mode and the transform job's
//! variables become the server's configuration (`config::ServerConfig`), whole, before
//! anything starts. Nothing after this reads a flag or a variable, and nothing changes
//! what it returns.

use std::time::Duration;

use super::args::ServeArgs;
use crate::codec::decode::DecodeLimits;
use crate::config::hosting::{BatchJob, Explicit};
use crate::config::{ConfigError, Fetch, HostingPlan, Replicas, RequestLimits, ServerConfig};
use crate::sched::{QueueBudget, SchedulerConfig};

/// The server's configuration from `args` and the environment, read through `var`
/// (`std::env::var` in the server): a hosting mode's limits under the settings given
/// explicitly, a transform job's concurrency admitted at once.
pub fn resolve(
    args: &ServeArgs,
    var: impl Fn(&str) -> Option<String>,
) -> Result<ServerConfig, ConfigError> {
    let explicit = Explicit {
        max_body_bytes: args.requests.max_body_bytes,
        max_response_bytes: args.hosting.max_response_bytes,
        deadline_s: args.requests.deadline_s,
        replicas: args.runtime.replicas,
    };
    let hosting = HostingPlan::resolve(
        args.hosting.mode,
        explicit,
        BatchJob::from_env(&var)?,
        args.requests.max_pixels,
    );
    let requests = RequestLimits {
        max_body_bytes: hosting.max_body_bytes,
        decode: DecodeLimits {
            max_pixels: args.requests.max_pixels,
            min_side_px: args.requests.min_side_px,
            max_side_px: DecodeLimits::default().max_side_px,
        },
        deadline: hosting.deadline,
    };
    // The modes whose requests wait their turn (batch, async) have no wait budget unless
    // one is given.
    let max_queue_wait =
        args.admission
            .max_queue_wait
            .unwrap_or(if hosting.mode.waits_its_turn() {
                QueueBudget::Off
            } else {
                QueueBudget::ServiceTimes(2.0)
            });
    let scheduler = SchedulerConfig {
        routing: args.admission.routing,
        scheduling: args.admission.scheduling,
        queue_capacity: hosting.queue_capacity(args.admission.queue_capacity),
        max_in_flight: args.admission.max_in_flight,
        max_queue_wait,
        health_check_interval: Duration::from_millis(args.admission.health_check_interval_ms),
        ..SchedulerConfig::default()
    };
    // The hosting plan already holds `--replicas` over the mode's own count.
    let replicas = Replicas {
        replicas: hosting.replicas,
        ..args.runtime.replicas()
    };
    Ok(ServerConfig {
        model_dir: args.runtime.model_dir.clone(),
        model_name: args.listen.model_name.clone(),
        bind: args.listen.bind.clone(),
        port: args.listen.port,
        grpc_port: Some(args.listen.grpc_port).filter(|&p| p != 0),
        connections: args
            .conn
            .limits()
            .fit_to_bodies(requests.max_body_bytes, requests.deadline),
        requests,
        scheduler,
        replicas,
        devices: args.device.devices(),
        fetch: Fetch {
            allow_hosts: args.requests.fetch_allow_hosts.clone(),
            timeout: Duration::from_millis(args.requests.fetch_timeout_ms),
        },
        server_timing: args.listen.server_timing,
        drain: Duration::from_secs(args.listen.drain_s),
        shutdown_grace: Duration::from_secs(args.listen.shutdown_grace_s),
        trace: crate::trace::TraceConfig::from_env(&var)?,
        hosting,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::args::tests::parse;
    use crate::config::HostingMode;

    fn resolved(flags: &[&str], vars: &[(&str, &str)]) -> ServerConfig {
        let args = parse(flags).unwrap();
        resolve(&args, |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        })
        .unwrap()
    }

    #[test]
    fn a_transform_job_is_admitted_whole_and_waits_its_turn() {
        let c = resolved(
            &["--queue-capacity=4"],
            &[
                ("SAGEMAKER_BATCH", "true"),
                ("SAGEMAKER_MAX_CONCURRENT_TRANSFORMS", "12"),
            ],
        );
        assert_eq!(c.hosting.mode, HostingMode::Batch);
        assert_eq!(c.scheduler.queue_capacity, 12);
        assert_eq!(c.scheduler.max_queue_wait, QueueBudget::Off);
        // A wait budget given explicitly holds in every mode.
        let c = resolved(&["--max-queue-wait=3s"], &[("SAGEMAKER_BATCH", "true")]);
        assert_eq!(
            c.scheduler.max_queue_wait,
            QueueBudget::Fixed(Duration::from_secs(3))
        );
    }

    #[test]
    fn realtime_defaults_to_two_service_times_and_serverless_to_one_replica() {
        let c = resolved(&[], &[]);
        assert_eq!(c.scheduler.max_queue_wait, QueueBudget::ServiceTimes(2.0));
        assert_eq!(c.replicas.replicas, None);
        let c = resolved(&["--hosting=serverless"], &[]);
        assert_eq!(c.replicas.replicas, Some(1));
        let c = resolved(&["--hosting=serverless", "--replicas=3"], &[]);
        assert_eq!(c.replicas.replicas, Some(3));
    }

    #[test]
    fn connection_limits_fit_the_largest_body_of_the_mode() {
        let c = resolved(&["--hosting=async"], &[]);
        assert!(c.connections.body_buffer_bytes >= c.requests.max_body_bytes);
        assert!(!c.to_string().is_empty());
    }

    #[test]
    fn a_variable_sagemaker_cannot_have_set_is_refused() {
        let args = parse(&[]).unwrap();
        let e = resolve(&args, |name| {
            (name == "SAGEMAKER_BATCH").then(|| "maybe".to_string())
        })
        .unwrap_err();
        assert_eq!(
            e.to_string(),
            "SAGEMAKER_BATCH=maybe: expected true or false"
        );
    }
}

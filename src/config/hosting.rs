//! SageMaker hosting modes as configuration. The same container serves real-time
//! endpoints, asynchronous inference, serverless endpoints and batch transform jobs, and
//! each allows different bodies, responses and times (facts and sources in
//! docs/hosting.md). `--hosting` (`CELER_HOSTING`) picks the mode; batch transform is
//! recognised by itself from `SAGEMAKER_BATCH=true`, which SageMaker sets for a transform
//! job together with the job's `SAGEMAKER_MAX_PAYLOAD_IN_MB`, `SAGEMAKER_BATCH_STRATEGY`
//! and `SAGEMAKER_MAX_CONCURRENT_TRANSFORMS`. A flag or variable set explicitly
//! (`--max-body-bytes`, `--deadline-s`, `--max-response-bytes`, `--replicas`) wins over
//! the mode.
//!
//! Request limits are in binary megabytes (the platform enforces its own cap first, so a
//! generous reading costs nothing); response limits are in decimal megabytes (a response
//! over the platform's cap is dropped by SageMaker, so the cautious reading is the safe
//! one).

use std::fmt;
use std::time::Duration;

use clap::ValueEnum;

use super::ConfigError;

const MIB: usize = 1024 * 1024;
/// The longest a batch transform invocation (`InvocationsTimeoutInSeconds`) or an
/// asynchronous invocation (`InvocationTimeoutSeconds`) may be allowed: an hour.
const LONGEST_INVOCATION_S: u64 = 3600;
/// The largest asynchronous inference payload (read from S3 by SageMaker): 1 GB.
const ASYNC_MAX_PAYLOAD: usize = 1 << 30;
/// `MaxPayloadInMB` of a transform job that does not set it, and the largest it may be.
const BATCH_DEFAULT_PAYLOAD_MB: u64 = 6;
const BATCH_MAX_PAYLOAD_MB: u64 = 100;

/// Where the container is hosted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum HostingMode {
    /// Real-time endpoints (InvokeEndpoint): 6 MB requests and responses, 60 s.
    Realtime,
    /// Asynchronous inference: payloads up to 1 GB from S3, up to an hour, the response
    /// written to S3.
    Async,
    /// Serverless endpoints: 4 MB requests and responses, 60 s, CPU only, 1-6 GB memory.
    Serverless,
    /// Batch transform jobs (set by itself when SAGEMAKER_BATCH=true).
    Batch,
}

impl HostingMode {
    /// Whether a request should wait its turn rather than be refused by the time budget
    /// of admission (`--max-queue-ms`): a transform job sends its own concurrency and
    /// expects each record answered, and an async invocation has up to an hour; only a
    /// count of places (which a job's concurrency raises) bounds their queue.
    pub fn waits_its_turn(self) -> bool {
        matches!(self, Self::Batch | Self::Async)
    }
}

impl fmt::Display for HostingMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Realtime => "realtime",
            Self::Async => "async",
            Self::Serverless => "serverless",
            Self::Batch => "batch",
        })
    }
}

/// How a transform job batches records. celer takes one image per request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchStrategy {
    SingleRecord,
    MultiRecord,
}

impl BatchStrategy {
    /// The spelling of `/execution-parameters` (`SINGLE_RECORD`).
    pub fn name(self) -> &'static str {
        match self {
            Self::SingleRecord => "SINGLE_RECORD",
            Self::MultiRecord => "MULTI_RECORD",
        }
    }
}

/// A transform job's settings, as SageMaker passes them in the environment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BatchJob {
    /// `SAGEMAKER_BATCH=true`.
    pub batch: bool,
    /// `SAGEMAKER_MAX_PAYLOAD_IN_MB`: 0 means the body comes chunked, of any size.
    pub max_payload_mb: Option<u64>,
    /// `SAGEMAKER_BATCH_STRATEGY`.
    pub strategy: Option<BatchStrategy>,
    /// `SAGEMAKER_MAX_CONCURRENT_TRANSFORMS` (0 or absent: the job asks
    /// `/execution-parameters`).
    pub max_concurrent: Option<usize>,
}

impl BatchJob {
    /// Reads the job's variables through `var` (`std::env::var` in the server); a value
    /// that cannot be what SageMaker sets is an error naming the variable.
    pub fn from_env(var: impl Fn(&str) -> Option<String>) -> Result<Self, ConfigError> {
        let get = |name: &str| {
            var(name)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        let wrong = |name: &str, value: &str, expected: String| ConfigError::Variable {
            name: name.to_string(),
            value: value.to_string(),
            expected,
        };
        let number = |name: &str| -> Result<Option<u64>, ConfigError> {
            get(name)
                .map(|v| {
                    v.parse::<u64>()
                        .map_err(|_| wrong(name, &v, "a whole number".into()))
                })
                .transpose()
        };
        let batch = match get("SAGEMAKER_BATCH").map(|v| v.to_ascii_lowercase()) {
            None => false,
            Some(v) if matches!(v.as_str(), "true" | "1" | "yes") => true,
            Some(v) if matches!(v.as_str(), "false" | "0" | "no") => false,
            Some(v) => return Err(wrong("SAGEMAKER_BATCH", &v, "true or false".into())),
        };
        let max_payload_mb = number("SAGEMAKER_MAX_PAYLOAD_IN_MB")?;
        if let Some(mb) = max_payload_mb.filter(|&mb| mb > BATCH_MAX_PAYLOAD_MB) {
            return Err(wrong(
                "SAGEMAKER_MAX_PAYLOAD_IN_MB",
                &mb.to_string(),
                format!("0 to {BATCH_MAX_PAYLOAD_MB} (what a transform job allows)"),
            ));
        }
        let strategy = match get("SAGEMAKER_BATCH_STRATEGY").map(|v| v.to_ascii_uppercase()) {
            None => None,
            Some(v) if matches!(v.as_str(), "SINGLE_RECORD" | "SINGLERECORD") => {
                Some(BatchStrategy::SingleRecord)
            }
            Some(v) if matches!(v.as_str(), "MULTI_RECORD" | "MULTIRECORD") => {
                Some(BatchStrategy::MultiRecord)
            }
            Some(v) => {
                return Err(wrong(
                    "SAGEMAKER_BATCH_STRATEGY",
                    &v,
                    "SINGLE_RECORD or MULTI_RECORD".into(),
                ))
            }
        };
        let max_concurrent = number("SAGEMAKER_MAX_CONCURRENT_TRANSFORMS")?
            .filter(|&n| n > 0)
            .map(|n| n as usize);
        Ok(Self {
            batch,
            max_payload_mb,
            strategy,
            max_concurrent,
        })
    }
}

/// What was set explicitly, by flag or variable (`None`: the mode decides).
#[derive(Debug, Clone, Copy, Default)]
pub struct Explicit {
    pub max_body_bytes: Option<usize>,
    pub max_response_bytes: Option<usize>,
    pub deadline_s: Option<u64>,
    pub replicas: Option<usize>,
}

/// The limits a server runs under, the mode's defaults with the explicit settings over
/// them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostingPlan {
    pub mode: HostingMode,
    pub max_body_bytes: usize,
    /// `None`: no limit.
    pub max_response_bytes: Option<usize>,
    pub deadline: Duration,
    /// Replicas per device when `--replicas` is not given (`None`: the cores decide).
    pub replicas: Option<usize>,
    /// The transform job, when there is one (its variables are read in every mode).
    pub job: BatchJob,
    /// Things the operator should know (a job setting overridden, a strategy celer
    /// cannot split by), for the log.
    pub notes: Vec<String>,
}

impl HostingPlan {
    /// The plan for `mode` (`None`: batch if the job says so, else realtime), images up
    /// to `max_pixels`.
    pub fn resolve(
        mode: Option<HostingMode>,
        explicit: Explicit,
        job: BatchJob,
        max_pixels: u64,
    ) -> Self {
        let mut notes = Vec::new();
        let mode = match mode {
            Some(m) => {
                if job.batch && m != HostingMode::Batch {
                    notes.push(format!(
                        "SAGEMAKER_BATCH=true but --hosting {m} was given: serving as {m}"
                    ));
                }
                m
            }
            None if job.batch => HostingMode::Batch,
            None => HostingMode::Realtime,
        };
        // The largest an image within the pixel limit can be encoded (16-bit RGBA,
        // uncompressed, plus headers): a bigger body cannot be an image celer takes, so
        // it is refused before it is read rather than after.
        let largest_image = usize::try_from(max_pixels.saturating_mul(8))
            .unwrap_or(usize::MAX)
            .saturating_add(MIB);
        let (body, response, deadline_s, replicas) = match mode {
            HostingMode::Realtime => (6 * MIB, Some(6_000_000), 60, None),
            HostingMode::Serverless => (4 * MIB, Some(4_000_000), 60, Some(1)),
            HostingMode::Async => (
                ASYNC_MAX_PAYLOAD.min(largest_image),
                None,
                LONGEST_INVOCATION_S,
                None,
            ),
            HostingMode::Batch => {
                let body = match job.max_payload_mb.unwrap_or(BATCH_DEFAULT_PAYLOAD_MB) {
                    // Chunked, of any size: any image within the pixel limit.
                    0 => largest_image,
                    mb => mb as usize * MIB,
                };
                (body, None, LONGEST_INVOCATION_S, None)
            }
        };
        if mode == HostingMode::Batch {
            if job.strategy == Some(BatchStrategy::MultiRecord) {
                notes.push(
                    "SAGEMAKER_BATCH_STRATEGY=MULTI_RECORD: celer takes one image per request, \
                     which a job with SplitType None sends whatever the strategy; a job that \
                     splits files into records would send parts of images"
                        .into(),
                );
            }
            if let (Some(asked), Some(mb)) = (explicit.max_body_bytes, job.max_payload_mb) {
                notes.push(format!(
                    "--max-body-bytes {asked} overrides the job's MaxPayloadInMB {mb}"
                ));
            }
        }
        Self {
            mode,
            max_body_bytes: explicit.max_body_bytes.unwrap_or(body),
            max_response_bytes: match explicit.max_response_bytes {
                Some(0) => None,
                Some(n) => Some(n),
                None => response,
            },
            deadline: Duration::from_secs(explicit.deadline_s.unwrap_or(deadline_s)),
            replicas: explicit.replicas.or(replicas),
            job,
            notes,
        }
    }

    /// `MaxPayloadInMB` for `/execution-parameters`: the job's when it set one, else the
    /// body limit in whole MB (at most the 100 a job allows, at least 1).
    pub fn max_payload_in_mb(&self) -> u64 {
        self.job
            .max_payload_mb
            .unwrap_or_else(|| ((self.max_body_bytes / MIB) as u64).clamp(1, BATCH_MAX_PAYLOAD_MB))
    }

    /// The queue capacity per device that admits the job's concurrency at once.
    pub fn queue_capacity(&self, configured: usize) -> usize {
        configured.max(self.job.max_concurrent.unwrap_or(0))
    }

    /// One line for the log.
    pub fn describe(&self) -> String {
        format!(
            "hosting {}: bodies up to {} bytes, responses {}, deadline {} s",
            self.mode,
            self.max_body_bytes,
            self.max_response_bytes
                .map_or("unlimited".to_string(), |n| format!("up to {n} bytes")),
            self.deadline.as_secs()
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PIXELS: u64 = 50_000_000;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| {
            pairs
                .iter()
                .find(|(k, _)| k == name)
                .map(|(_, v)| v.clone())
        }
    }

    fn plan(mode: Option<HostingMode>, vars: &[(&str, &str)]) -> HostingPlan {
        let job = BatchJob::from_env(env(vars)).unwrap();
        HostingPlan::resolve(mode, Explicit::default(), job, PIXELS)
    }

    #[test]
    fn each_mode_sets_what_the_platform_allows() {
        let rt = plan(None, &[]);
        assert_eq!(rt.mode, HostingMode::Realtime);
        assert_eq!(rt.max_body_bytes, 6 * MIB);
        assert_eq!(rt.max_response_bytes, Some(6_000_000));
        assert_eq!(rt.deadline, Duration::from_secs(60));
        assert_eq!(rt.replicas, None);

        let sl = plan(Some(HostingMode::Serverless), &[]);
        assert_eq!(
            (
                sl.max_body_bytes,
                sl.max_response_bytes,
                sl.deadline.as_secs(),
                sl.replicas
            ),
            (4 * MIB, Some(4_000_000), 60, Some(1))
        );

        let asy = plan(Some(HostingMode::Async), &[]);
        // 50 MP x 8 bytes + 1 MiB: under async's 1 GB.
        assert_eq!(asy.max_body_bytes, 400_000_000 + MIB);
        assert_eq!(
            (asy.max_response_bytes, asy.deadline.as_secs()),
            (None, 3600)
        );
        let huge = HostingPlan::resolve(
            Some(HostingMode::Async),
            Explicit::default(),
            BatchJob::default(),
            1 << 40,
        );
        assert_eq!(huge.max_body_bytes, 1 << 30);
    }

    #[test]
    fn a_transform_job_is_recognised_and_its_settings_followed() {
        let p = plan(
            None,
            &[
                ("SAGEMAKER_BATCH", "true"),
                ("SAGEMAKER_MAX_PAYLOAD_IN_MB", "20"),
                ("SAGEMAKER_BATCH_STRATEGY", "SINGLE_RECORD"),
                ("SAGEMAKER_MAX_CONCURRENT_TRANSFORMS", "24"),
            ],
        );
        assert_eq!(p.mode, HostingMode::Batch);
        assert_eq!(p.max_body_bytes, 20 * MIB);
        assert_eq!((p.max_response_bytes, p.deadline.as_secs()), (None, 3600));
        assert_eq!(p.max_payload_in_mb(), 20);
        assert_eq!(p.queue_capacity(16), 24);
        assert_eq!(p.queue_capacity(32), 32);
        assert!(p.notes.is_empty(), "{:?}", p.notes);

        // Without the job's payload: 6 MB, as SageMaker's default.
        let d = plan(None, &[("SAGEMAKER_BATCH", "True")]);
        assert_eq!((d.max_body_bytes, d.max_payload_in_mb()), (6 * MIB, 6));
        // 0: chunked, any image within the pixel limit.
        let chunked = plan(
            None,
            &[
                ("SAGEMAKER_BATCH", "true"),
                ("SAGEMAKER_MAX_PAYLOAD_IN_MB", "0"),
            ],
        );
        assert_eq!(chunked.max_body_bytes, 400_000_000 + MIB);
        assert_eq!(chunked.max_payload_in_mb(), 0);
        let multi = plan(
            None,
            &[
                ("SAGEMAKER_BATCH", "true"),
                ("SAGEMAKER_BATCH_STRATEGY", "MULTI_RECORD"),
            ],
        );
        assert!(
            multi.notes[0].contains("one image per request"),
            "{:?}",
            multi.notes
        );
    }

    #[test]
    fn explicit_settings_win_over_the_mode() {
        let job = BatchJob::from_env(env(&[
            ("SAGEMAKER_BATCH", "true"),
            ("SAGEMAKER_MAX_PAYLOAD_IN_MB", "50"),
        ]))
        .unwrap();
        let p = HostingPlan::resolve(
            None,
            Explicit {
                max_body_bytes: Some(1000),
                max_response_bytes: Some(0),
                deadline_s: Some(5),
                replicas: Some(3),
            },
            job,
            PIXELS,
        );
        assert_eq!(p.max_body_bytes, 1000);
        assert_eq!(p.max_response_bytes, None);
        assert_eq!(p.deadline.as_secs(), 5);
        assert_eq!(p.replicas, Some(3));
        assert!(p.notes[0].contains("overrides the job's MaxPayloadInMB 50"));
        // An explicit mode wins over SAGEMAKER_BATCH, said in the log.
        let rt = plan(Some(HostingMode::Realtime), &[("SAGEMAKER_BATCH", "true")]);
        assert_eq!(rt.mode, HostingMode::Realtime);
        assert_eq!(rt.notes.len(), 1);
    }

    #[test]
    fn job_variables_that_sagemaker_cannot_have_set_are_errors() {
        for (k, v) in [
            ("SAGEMAKER_BATCH", "maybe"),
            ("SAGEMAKER_MAX_PAYLOAD_IN_MB", "six"),
            ("SAGEMAKER_MAX_PAYLOAD_IN_MB", "101"),
            ("SAGEMAKER_BATCH_STRATEGY", "ALL"),
            ("SAGEMAKER_MAX_CONCURRENT_TRANSFORMS", "-1"),
        ] {
            let e = BatchJob::from_env(env(&[(k, v)])).unwrap_err();
            assert!(e.to_string().starts_with(k), "{e}");
        }
        let zero =
            BatchJob::from_env(env(&[("SAGEMAKER_MAX_CONCURRENT_TRANSFORMS", "0")])).unwrap();
        assert_eq!(zero.max_concurrent, None);
    }
}

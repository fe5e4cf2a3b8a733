//! Distributed tracing, OpenTelemetry's way: a caller's W3C `traceparent` is taken up,
//! each sampled request becomes a span tree, and the spans go to a collector over OTLP/HTTP
//! in batches. Configured by the standard `OTEL_*` variables (`TraceConfig::from_env`);
//! with no OTLP endpoint set there is no tracer at all, so nothing is sampled, built or
//! sent, and the request path only checks an `Option`.
//!
//! The ground floor: this module knows spans, not requests; `http::spans` builds them.

pub mod context;
mod export;
pub mod otlp;

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use tokio::sync::mpsc;

pub use context::{SpanId, TraceId, TraceParent};
pub use otlp::{Attribute, Resource, SpanKind, SpanRecord, Status, Value};

/// How spans are encoded on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    HttpProtobuf,
    HttpJson,
}

/// Which requests are traced (`OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampler {
    AlwaysOn,
    AlwaysOff,
    /// A share of traces, by trace id.
    Ratio(f64),
    /// The caller's decision when it sent a `traceparent`, else the inner sampler's.
    ParentBased(RootSampler),
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RootSampler {
    AlwaysOn,
    AlwaysOff,
    Ratio(f64),
}

/// Everything the tracer runs by.
#[derive(Debug, Clone, PartialEq)]
pub struct TraceConfig {
    /// Where spans are POSTed: the traces endpoint as given, or the base endpoint with
    /// `/v1/traces`.
    pub endpoint: String,
    pub protocol: Protocol,
    pub headers: Vec<(String, String)>,
    pub timeout: Duration,
    pub sampler: Sampler,
    pub resource: Resource,
    /// The batch span processor's settings (`OTEL_BSP_*`).
    pub schedule_delay: Duration,
    pub max_queue: usize,
    pub max_batch: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TraceConfigError {
    #[error("{name}={value}: {why}")]
    Invalid {
        name: &'static str,
        value: String,
        why: &'static str,
    },
}

fn invalid(name: &'static str, value: &str, why: &'static str) -> TraceConfigError {
    TraceConfigError::Invalid {
        name,
        value: value.to_string(),
        why,
    }
}

impl TraceConfig {
    /// The tracer the `OTEL_*` variables ask for, read through `var`: `None` when no OTLP
    /// endpoint is set, `OTEL_SDK_DISABLED` is true or `OTEL_TRACES_EXPORTER` is `none`.
    pub fn from_env(
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<Self>, TraceConfigError> {
        let get = |name: &str| {
            var(name)
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        // The signal's own variable first, then the general one.
        let either = |traces: &'static str, general: &'static str| {
            get(traces)
                .map(|v| (traces, v))
                .or_else(|| get(general).map(|v| (general, v)))
        };
        if get("OTEL_SDK_DISABLED").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        match get("OTEL_TRACES_EXPORTER").as_deref() {
            None | Some("otlp") => {}
            Some("none") => return Ok(None),
            Some(other) => {
                return Err(invalid(
                    "OTEL_TRACES_EXPORTER",
                    other,
                    "celer exports traces by OTLP only (otlp, or none)",
                ))
            }
        }
        let endpoint = if let Some(e) = get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") {
            e
        } else if let Some(base) = get("OTEL_EXPORTER_OTLP_ENDPOINT") {
            format!("{}/v1/traces", base.trim_end_matches('/'))
        } else {
            return Ok(None);
        };
        if !(endpoint.starts_with("http://") || endpoint.starts_with("https://")) {
            return Err(invalid(
                "OTEL_EXPORTER_OTLP_ENDPOINT",
                &endpoint,
                "an http:// or https:// URL",
            ));
        }
        let protocol = match either("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL") {
            None => Protocol::HttpProtobuf,
            Some((_, p)) if p == "http/protobuf" => Protocol::HttpProtobuf,
            Some((_, p)) if p == "http/json" => Protocol::HttpJson,
            Some((name, p)) => {
                return Err(invalid(
                    name,
                    &p,
                    "celer sends OTLP over HTTP: http/protobuf (the default) or http/json; a collector's OTLP/HTTP receiver listens on port 4318",
                ))
            }
        };
        let headers = match either(
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
            "OTEL_EXPORTER_OTLP_HEADERS",
        ) {
            None => Vec::new(),
            Some((name, list)) => parse_pairs(&list).ok_or_else(|| {
                invalid(
                    name,
                    &list,
                    "comma-separated key=value pairs, values percent-encoded",
                )
            })?,
        };
        let millis = |traces: &'static str, general: &'static str, default: u64| match either(
            traces, general,
        ) {
            None => Ok(default),
            Some((name, v)) => v
                .parse::<u64>()
                .map_err(|_| invalid(name, &v, "a whole number of milliseconds")),
        };
        let timeout = Duration::from_millis(millis(
            "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT",
            "OTEL_EXPORTER_OTLP_TIMEOUT",
            10_000,
        )?);
        let count = |name: &'static str, default: usize| match get(name) {
            None => Ok(default),
            Some(v) => v
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| invalid(name, &v, "a positive whole number")),
        };
        let schedule_delay = Duration::from_millis(match get("OTEL_BSP_SCHEDULE_DELAY") {
            None => 5_000,
            Some(v) => v
                .parse()
                .map_err(|_| invalid("OTEL_BSP_SCHEDULE_DELAY", &v, "milliseconds"))?,
        });
        let max_queue = count("OTEL_BSP_MAX_QUEUE_SIZE", 2048)?;
        let max_batch = count("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)?.min(max_queue);
        Ok(Some(Self {
            endpoint,
            protocol,
            headers,
            timeout,
            sampler: sampler(get("OTEL_TRACES_SAMPLER"), get("OTEL_TRACES_SAMPLER_ARG"))?,
            resource: resource(get("OTEL_SERVICE_NAME"), get("OTEL_RESOURCE_ATTRIBUTES"))?,
            schedule_delay,
            max_queue,
            max_batch,
        }))
    }

    /// One line for the start-up log.
    pub fn describe(&self) -> String {
        let protocol = match self.protocol {
            Protocol::HttpProtobuf => "http/protobuf",
            Protocol::HttpJson => "http/json",
        };
        format!(
            "traces to {} ({protocol}), sampler {:?}, batches every {} ms",
            self.endpoint,
            self.sampler,
            self.schedule_delay.as_millis()
        )
    }
}

fn sampler(name: Option<String>, arg: Option<String>) -> Result<Sampler, TraceConfigError> {
    let ratio = || -> Result<f64, TraceConfigError> {
        match &arg {
            None => Ok(1.0),
            Some(a) => a
                .parse::<f64>()
                .ok()
                .filter(|r| (0.0..=1.0).contains(r))
                .ok_or_else(|| invalid("OTEL_TRACES_SAMPLER_ARG", a, "a ratio from 0 to 1")),
        }
    };
    Ok(match name.as_deref() {
        None | Some("parentbased_always_on") => Sampler::ParentBased(RootSampler::AlwaysOn),
        Some("parentbased_always_off") => Sampler::ParentBased(RootSampler::AlwaysOff),
        Some("parentbased_traceidratio") => Sampler::ParentBased(RootSampler::Ratio(ratio()?)),
        Some("always_on") => Sampler::AlwaysOn,
        Some("always_off") => Sampler::AlwaysOff,
        Some("traceidratio") => Sampler::Ratio(ratio()?),
        Some(other) => {
            return Err(invalid(
                "OTEL_TRACES_SAMPLER",
                other,
                "one of always_on, always_off, traceidratio and their parentbased_ forms",
            ))
        }
    })
}

/// `service.name` from `OTEL_SERVICE_NAME` (else the attributes' own, else `celer`), the
/// SDK's own attributes, then `OTEL_RESOURCE_ATTRIBUTES`.
fn resource(
    service: Option<String>,
    attributes: Option<String>,
) -> Result<Resource, TraceConfigError> {
    let mut map: BTreeMap<String, String> = BTreeMap::new();
    if let Some(list) = &attributes {
        let pairs = parse_pairs(list).ok_or_else(|| {
            invalid(
                "OTEL_RESOURCE_ATTRIBUTES",
                list,
                "comma-separated key=value pairs",
            )
        })?;
        map.extend(pairs);
    }
    if let Some(name) = service {
        map.insert("service.name".into(), name);
    }
    map.entry("service.name".into())
        .or_insert_with(|| "celer".into());
    map.insert("service.version".into(), env!("CARGO_PKG_VERSION").into());
    map.insert("telemetry.sdk.name".into(), "celer".into());
    map.insert("telemetry.sdk.language".into(), "rust".into());
    Ok(Resource {
        attributes: map
            .into_iter()
            .map(|(k, v)| (Cow::Owned(k), Value::Str(Cow::Owned(v))))
            .collect(),
    })
}

/// `k1=v1,k2=v2` (W3C Baggage's form, values percent-encoded), as OTel's variables
/// write headers and resource attributes.
fn parse_pairs(list: &str) -> Option<Vec<(String, String)>> {
    list.split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=')?;
            let k = k.trim();
            if k.is_empty() {
                return None;
            }
            let v = url::form_urlencoded::parse(
                format!("v={}", v.trim().replace('+', "%2B")).as_bytes(),
            )
            .next()
            .map(|(_, v)| v.into_owned())
            .unwrap_or_default();
            Some((k.to_string(), v))
        })
        .collect()
}

/// Running: decides which requests are traced and queues their spans for the exporter.
pub struct Tracer {
    sampler: Sampler,
    spans: mpsc::Sender<SpanRecord>,
    dropped: AtomicU64,
    /// Set at shutdown: the exporter sends what is queued and ends.
    stop: tokio::sync::watch::Sender<bool>,
    /// The exporter task, joined at shutdown so that the last spans are sent.
    exporter: Mutex<Option<tokio::task::JoinHandle<()>>>,
    /// The wall clock at a known instant: spans are timed by `Instant` (monotonic) and
    /// exported in Unix nanoseconds.
    epoch: (Instant, SystemTime),
}

/// A traced request's identity: the trace it belongs to and its own span.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sampled {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    pub parent: Option<SpanId>,
    pub trace_state: Option<String>,
}

impl Tracer {
    /// Starts the exporter on the current Tokio runtime.
    pub fn start(config: TraceConfig) -> Self {
        let (tx, rx) = mpsc::channel(config.max_queue);
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let sampler = config.sampler;
        let exporter = tokio::spawn(export::run(config, rx, stopped));
        Self {
            sampler,
            spans: tx,
            dropped: AtomicU64::new(0),
            stop,
            exporter: Mutex::new(Some(exporter)),
            epoch: (Instant::now(), SystemTime::now()),
        }
    }

    /// Whether a request with this `traceparent` (if any) is traced, and as which span.
    pub fn sample(&self, parent: Option<TraceParent>) -> Option<Sampled> {
        let trace_id = parent.as_ref().map_or_else(TraceId::random, |p| p.trace_id);
        let by_ratio = |r: f64| {
            // Compared on the id's lower 8 bytes, so every service decides alike.
            r >= 1.0 || (trace_id.low_u64() as f64) < r * u64::MAX as f64
        };
        let root = |s: RootSampler| match s {
            RootSampler::AlwaysOn => true,
            RootSampler::AlwaysOff => false,
            RootSampler::Ratio(r) => by_ratio(r),
        };
        let sampled = match self.sampler {
            Sampler::AlwaysOn => true,
            Sampler::AlwaysOff => false,
            Sampler::Ratio(r) => by_ratio(r),
            Sampler::ParentBased(s) => parent.as_ref().map_or_else(|| root(s), |p| p.sampled),
        };
        sampled.then(|| Sampled {
            trace_id,
            span_id: SpanId::random(),
            parent: parent.as_ref().map(|p| p.span_id),
            trace_state: parent.and_then(|p| p.state),
        })
    }

    /// `at` in Unix nanoseconds.
    pub fn unix_ns(&self, at: Instant) -> u64 {
        let (instant, wall) = self.epoch;
        let since_epoch = wall.duration_since(UNIX_EPOCH).unwrap_or_default();
        let t = if at >= instant {
            since_epoch + (at - instant)
        } else {
            since_epoch.saturating_sub(instant - at)
        };
        u64::try_from(t.as_nanos()).unwrap_or(u64::MAX)
    }

    /// Queues finished spans for export; never waits: when the queue is full (the
    /// collector is slow or gone) they are dropped and counted.
    pub fn record(&self, spans: Vec<SpanRecord>) {
        for span in spans {
            if self.spans.try_send(span).is_err() {
                let dropped = self.dropped.fetch_add(1, Ordering::Relaxed) + 1;
                if dropped.is_power_of_two() {
                    tracing::warn!(dropped, "the span queue is full: spans dropped");
                }
            }
        }
    }

    /// Sends what is queued and stops the exporter, waiting at most `within`.
    pub async fn shutdown(&self, within: Duration) {
        let exporter = self
            .exporter
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        self.stop.send_replace(true);
        if let Some(task) = exporter {
            if tokio::time::timeout(within, task).await.is_err() {
                tracing::warn!("spans still unsent at shutdown were dropped");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn no_endpoint_no_tracer() {
        assert_eq!(TraceConfig::from_env(env(&[])), Ok(None));
        let disabled = env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
            ("OTEL_SDK_DISABLED", "true"),
        ]);
        assert_eq!(TraceConfig::from_env(disabled), Ok(None));
        let none = env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
            ("OTEL_TRACES_EXPORTER", "none"),
        ]);
        assert_eq!(TraceConfig::from_env(none), Ok(None));
    }

    #[test]
    fn the_standard_variables_are_read_as_the_specification_says() {
        let c = TraceConfig::from_env(env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318/"),
            (
                "OTEL_EXPORTER_OTLP_HEADERS",
                "api-key=s%3Dcret, tenant = a b",
            ),
            ("OTEL_SERVICE_NAME", "matting"),
            (
                "OTEL_RESOURCE_ATTRIBUTES",
                "service.name=ignored,deployment.environment=prod",
            ),
            ("OTEL_TRACES_SAMPLER", "parentbased_traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", "0.25"),
            ("OTEL_BSP_SCHEDULE_DELAY", "200"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(c.endpoint, "http://collector:4318/v1/traces");
        assert_eq!(c.protocol, Protocol::HttpProtobuf);
        assert_eq!(
            c.headers,
            [
                ("api-key".into(), "s=cret".into()),
                ("tenant".into(), "a b".into())
            ]
        );
        assert_eq!(c.sampler, Sampler::ParentBased(RootSampler::Ratio(0.25)));
        assert_eq!(c.schedule_delay, Duration::from_millis(200));
        assert_eq!(c.timeout, Duration::from_secs(10));
        let attr = |key: &str| {
            c.resource
                .attributes
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.clone())
        };
        assert_eq!(attr("service.name"), Some(Value::Str("matting".into())));
        assert_eq!(
            attr("deployment.environment"),
            Some(Value::Str("prod".into()))
        );

        // The signal's own endpoint is used as given; its protocol wins.
        let c = TraceConfig::from_env(env(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://ignored:4318"),
            (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "https://otlp.example.com/traces",
            ),
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json"),
        ]))
        .unwrap()
        .unwrap();
        assert_eq!(c.endpoint, "https://otlp.example.com/traces");
        assert_eq!(c.protocol, Protocol::HttpJson);
    }

    #[test]
    fn what_celer_cannot_do_is_refused_at_start_up_by_name() {
        for (name, value) in [
            ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ("OTEL_TRACES_SAMPLER", "jaeger_remote"),
            ("OTEL_TRACES_SAMPLER_ARG", "1.5"),
            ("OTEL_EXPORTER_OTLP_TIMEOUT", "ten"),
            ("OTEL_TRACES_EXPORTER", "zipkin"),
        ] {
            let sampler = if name == "OTEL_TRACES_SAMPLER_ARG" {
                "traceidratio"
            } else {
                "always_on"
            };
            let e = TraceConfig::from_env(env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318"),
                ("OTEL_TRACES_SAMPLER", sampler),
                (name, value),
            ]))
            .unwrap_err();
            assert!(e.to_string().starts_with(&format!("{name}={value}")), "{e}");
        }
    }

    #[tokio::test]
    async fn a_callers_decision_is_followed_and_its_trace_continued() {
        let config = TraceConfig::from_env(env(&[(
            "OTEL_EXPORTER_OTLP_ENDPOINT",
            "http://127.0.0.1:9",
        )]))
        .unwrap()
        .unwrap();
        let tracer = Tracer::start(config);
        let parent = TraceParent::parse(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            Some("congo=t61rcWkgMzE"),
        )
        .unwrap();
        let s = tracer
            .sample(Some(parent.clone()))
            .expect("sampled by its parent");
        assert_eq!(s.trace_id, parent.trace_id);
        assert_eq!(s.parent, Some(parent.span_id));
        assert_eq!(s.trace_state.as_deref(), Some("congo=t61rcWkgMzE"));
        assert_ne!(s.span_id, parent.span_id);
        let unsampled = TraceParent {
            sampled: false,
            ..parent
        };
        assert_eq!(tracer.sample(Some(unsampled)), None);
        let root = tracer.sample(None).expect("a new trace");
        assert_eq!(root.parent, None);
        let t = Instant::now();
        let later = t + Duration::from_millis(3);
        assert_eq!(tracer.unix_ns(later) - tracer.unix_ns(t), 3_000_000);
        tracer.shutdown(Duration::from_millis(100)).await;
    }
}

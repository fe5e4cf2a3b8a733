//! The batch span processor: a task that gathers queued spans and POSTs them to the
//! collector when a batch is full or the schedule delay has passed since its first span,
//! and sends what is left when the queue closes. A failed export is logged and its spans
//! dropped (as OpenTelemetry's SDKs do): tracing never holds a request back.

use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};

use super::otlp::{encode_json, encode_protobuf, SpanRecord};
use super::{Protocol, TraceConfig};

/// Logs a failure at most this often (a collector that is down fails every batch).
const WARN_EVERY: Duration = Duration::from_secs(60);

pub async fn run(
    config: TraceConfig,
    mut spans: mpsc::Receiver<SpanRecord>,
    mut stop: watch::Receiver<bool>,
) {
    let client = match reqwest::Client::builder().timeout(config.timeout).build() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(error = %e, "no HTTP client for OTLP: traces are not exported");
            while spans.recv().await.is_some() {}
            return;
        }
    };
    let mut exporter = Exporter {
        config,
        client,
        last_warning: None,
    };
    let mut batch: Vec<SpanRecord> = Vec::new();
    let mut due: Option<Instant> = None;
    let far = || Instant::now() + Duration::from_secs(3600);
    loop {
        let next = tokio::select! {
            span = spans.recv() => span,
            () = tokio::time::sleep_until(due.unwrap_or_else(far).into()), if due.is_some() => {
                exporter.send(std::mem::take(&mut batch)).await;
                due = None;
                continue;
            }
            _ = stop.changed() => None,
        };
        let Some(span) = next else {
            // Shutdown (or the tracer gone): what is queued goes now, in batches.
            while let Ok(span) = spans.try_recv() {
                batch.push(span);
                if batch.len() >= exporter.config.max_batch {
                    exporter.send(std::mem::take(&mut batch)).await;
                }
            }
            exporter.send(batch).await;
            return;
        };
        if batch.is_empty() {
            due = Some(Instant::now() + exporter.config.schedule_delay);
        }
        batch.push(span);
        if batch.len() >= exporter.config.max_batch {
            exporter.send(std::mem::take(&mut batch)).await;
            due = None;
        }
    }
}

struct Exporter {
    config: TraceConfig,
    client: reqwest::Client,
    last_warning: Option<Instant>,
}

impl Exporter {
    async fn send(&mut self, batch: Vec<SpanRecord>) {
        if batch.is_empty() {
            return;
        }
        let (body, content_type) = match self.config.protocol {
            Protocol::HttpProtobuf => (
                encode_protobuf(&self.config.resource, &batch),
                "application/x-protobuf",
            ),
            Protocol::HttpJson => (
                encode_json(&self.config.resource, &batch),
                "application/json",
            ),
        };
        let mut request = self
            .client
            .post(&self.config.endpoint)
            .header(reqwest::header::CONTENT_TYPE, content_type)
            .body(body);
        for (name, value) in &self.config.headers {
            request = request.header(name.as_str(), value.as_str());
        }
        let failure = match request.send().await {
            Ok(r) if r.status().is_success() => return,
            Ok(r) => format!("the collector answered {}", r.status()),
            Err(e) => e.to_string(),
        };
        let now = Instant::now();
        if self
            .last_warning
            .is_none_or(|at| now.duration_since(at) >= WARN_EVERY)
        {
            self.last_warning = Some(now);
            tracing::warn!(
                endpoint = %self.config.endpoint,
                spans = batch.len(),
                error = %failure,
                "spans not exported (logged at most once a minute)"
            );
        }
    }
}

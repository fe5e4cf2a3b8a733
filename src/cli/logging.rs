//! Where celer's log goes and how it reads: to stderr, as text for a person or, with
//! `CELER_LOG_FORMAT=json`, one JSON object a line (what CloudWatch Logs Insights and a
//! cluster's log shipper parse without a pattern). The filter is `CELER_LOG`, else
//! `RUST_LOG`, else `info,ort=warn`, in `tracing`'s `EnvFilter` syntax.

use std::io::IsTerminal;

use anyhow::Context;

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogFormat {
    Text,
    Json,
}

impl LogFormat {
    /// `CELER_LOG_FORMAT`'s value (`text` when unset or empty).
    pub fn parse(value: Option<&str>) -> anyhow::Result<Self> {
        match value.map(str::trim).unwrap_or("") {
            "" | "text" => Ok(Self::Text),
            "json" => Ok(Self::Json),
            other => anyhow::bail!("CELER_LOG_FORMAT={other}: expected text or json"),
        }
    }
}

/// The filter: the first of `CELER_LOG` and `RUST_LOG` that is set and not empty.
pub fn filter_text(celer_log: Option<&str>, rust_log: Option<&str>) -> String {
    [celer_log, rust_log]
        .into_iter()
        .flatten()
        .map(str::trim)
        .find(|v| !v.is_empty())
        .unwrap_or("info,ort=warn")
        .to_string()
}

/// Installs the process's subscriber from the environment.
pub fn init() -> anyhow::Result<()> {
    let var = |name| std::env::var(name).ok();
    let format = LogFormat::parse(var("CELER_LOG_FORMAT").as_deref())?;
    let text = filter_text(var("CELER_LOG").as_deref(), var("RUST_LOG").as_deref());
    let filter = tracing_subscriber::EnvFilter::try_new(&text)
        .with_context(|| format!("the log filter `{text}` (CELER_LOG or RUST_LOG)"))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        // Colour only for a person at a terminal: a container's log (CloudWatch,
        // journald, a file) would keep the escape codes as text.
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        // The event's fields at the top level beside `timestamp`, `level`, `target` and
        // `message`: a query names `request_id`, not `fields.request_id`.
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .init(),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_and_filter_from_the_environment() {
        assert_eq!(LogFormat::parse(None).unwrap(), LogFormat::Text);
        assert_eq!(LogFormat::parse(Some("json")).unwrap(), LogFormat::Json);
        assert_eq!(LogFormat::parse(Some(" text ")).unwrap(), LogFormat::Text);
        assert!(LogFormat::parse(Some("xml")).is_err());
        assert_eq!(filter_text(None, None), "info,ort=warn");
        assert_eq!(filter_text(None, Some("debug")), "debug");
        assert_eq!(filter_text(Some("warn"), Some("debug")), "warn");
        assert_eq!(filter_text(Some(""), Some("debug")), "debug");
    }
}

//! The Prometheus text format, version 0.0.4: what `/metrics` answers, as Triton's does.
//! Not OpenMetrics: OpenMetrics requires a counter's samples to end in `_total`, and
//! Prometheus stores them so, which would rename Triton's `nv_inference_request_success`
//! and break the dashboards written for it. celer's own families come from the
//! `prometheus_client` registry, whose OpenMetrics text `from_openmetrics` rewrites; the
//! figures read at scrape time (Triton's, the process's, the autoscaling signals) are
//! written here directly.

use std::fmt::Write as _;

pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
        }
    }
}

/// A text exposition being written: families, each a `# HELP`, a `# TYPE` and samples.
#[derive(Default)]
pub struct Exposition {
    text: String,
}

impl Exposition {
    /// Starts with `text`, already in this format.
    pub fn new(text: String) -> Self {
        Self { text }
    }

    /// A family with one sample per `(labels, value)`.
    pub fn family<'a>(
        &mut self,
        name: &str,
        help: &str,
        kind: Kind,
        samples: impl IntoIterator<Item = (&'a [(&'a str, &'a str)], f64)>,
    ) {
        // Writing to a String cannot fail.
        let _ = writeln!(self.text, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(self.text, "# TYPE {name} {}", kind.name());
        for (labels, value) in samples {
            self.text.push_str(name);
            if !labels.is_empty() {
                self.text.push('{');
                for (i, (label, v)) in labels.iter().enumerate() {
                    if i > 0 {
                        self.text.push(',');
                    }
                    let _ = write!(self.text, "{label}=\"{}\"", escape_value(v));
                }
                self.text.push('}');
            }
            let _ = writeln!(self.text, " {}", number(value));
        }
    }

    /// A family of one unlabelled sample.
    pub fn single(&mut self, name: &str, help: &str, kind: Kind, value: f64) {
        self.family(name, help, kind, [(&[][..], value)]);
    }

    pub fn finish(self) -> String {
        self.text
    }
}

/// `prometheus_client`'s OpenMetrics text as version 0.0.4: a counter family's `# HELP`
/// and `# TYPE` name its samples (`x_total`), `# UNIT` and `# EOF` go. The samples and
/// their escaping are the same in both formats.
pub fn from_openmetrics(openmetrics: &str) -> String {
    let mut out = String::with_capacity(openmetrics.len());
    // A family's HELP comes before its TYPE, which says whether it is renamed.
    let mut help: Option<(&str, &str)> = None;
    for line in openmetrics.lines() {
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, text) = rest.split_once(' ').unwrap_or((rest, ""));
            help = Some((name, text));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let exposed = if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_string()
            };
            if let Some((_, text)) = help.take().filter(|(n, _)| *n == name) {
                let _ = writeln!(out, "# HELP {exposed} {text}");
            }
            let _ = writeln!(out, "# TYPE {exposed} {kind}");
        } else if line.starts_with("# UNIT ") || line == "# EOF" {
            continue;
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

fn escape_help(help: &str) -> String {
    help.replace('\\', "\\\\").replace('\n', "\\n")
}

fn escape_value(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// Integers without a fraction (counters of microseconds read as Triton's do), others in
/// Rust's shortest round-trip form.
fn number(value: f64) -> String {
    if value.is_nan() {
        "NaN".into()
    } else if value.is_infinite() {
        if value > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else if value.fract() == 0.0 && value.abs() < 1e15 {
        format!("{}", value as i64)
    } else {
        format!("{value}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openmetrics_counters_are_named_by_their_samples() {
        let om = "# HELP celer_http_requests HTTP requests.\n\
                  # TYPE celer_http_requests counter\n\
                  celer_http_requests_total{path=\"/ping\"} 3\n\
                  # HELP celer_in_flight Requests running.\n\
                  # TYPE celer_in_flight gauge\n\
                  # UNIT celer_in_flight requests\n\
                  celer_in_flight 2\n\
                  # EOF\n";
        assert_eq!(
            from_openmetrics(om),
            "# HELP celer_http_requests_total HTTP requests.\n\
             # TYPE celer_http_requests_total counter\n\
             celer_http_requests_total{path=\"/ping\"} 3\n\
             # HELP celer_in_flight Requests running.\n\
             # TYPE celer_in_flight gauge\n\
             celer_in_flight 2\n"
        );
    }

    #[test]
    fn families_are_written_with_escaped_labels() {
        let mut e = Exposition::default();
        e.family(
            "nv_inference_count",
            "Inferences\nperformed",
            Kind::Counter,
            [
                (&[("model", "u2\"netp"), ("version", "1")][..], 12.0),
                (&[("model", "b\\c"), ("version", "1")][..], 0.5),
            ],
        );
        e.single("up", "Up", Kind::Gauge, f64::INFINITY);
        assert_eq!(
            e.finish(),
            "# HELP nv_inference_count Inferences\\nperformed\n\
             # TYPE nv_inference_count counter\n\
             nv_inference_count{model=\"u2\\\"netp\",version=\"1\"} 12\n\
             nv_inference_count{model=\"b\\\\c\",version=\"1\"} 0.5\n\
             # HELP up Up\n\
             # TYPE up gauge\n\
             up +Inf\n"
        );
    }
}

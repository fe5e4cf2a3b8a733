//! W3C Trace Context: the `traceparent` a caller sends (`00-<trace id>-<parent span
//! id>-<flags>`, lowercase hex) and its `tracestate`, kept as sent. A malformed header is
//! ignored, as the specification says: the request starts a new trace.

use std::fmt;

/// A trace's 16 bytes; never all zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceId(pub [u8; 16]);

/// A span's 8 bytes; never all zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SpanId(pub [u8; 8]);

impl TraceId {
    pub fn random() -> Self {
        loop {
            let id = fastrand::u128(..);
            if id != 0 {
                return Self(id.to_be_bytes());
            }
        }
    }

    /// The lower 8 bytes as a number: what a ratio sampler compares, the same decision
    /// for the same trace wherever it is taken.
    pub fn low_u64(&self) -> u64 {
        let mut low = [0; 8];
        low.copy_from_slice(&self.0[8..]);
        u64::from_be_bytes(low)
    }
}

impl SpanId {
    pub fn random() -> Self {
        loop {
            let id = fastrand::u64(..);
            if id != 0 {
                return Self(id.to_be_bytes());
            }
        }
    }
}

impl fmt::Display for TraceId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

impl fmt::Display for SpanId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&hex(&self.0))
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// What a caller's `traceparent` (and `tracestate`) said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: TraceId,
    /// The caller's span: the parent of this server's.
    pub span_id: SpanId,
    /// The caller sampled the trace (flag bit 0).
    pub sampled: bool,
    /// Vendors' entries, passed on untouched.
    pub state: Option<String>,
}

impl TraceParent {
    /// The headers' values, or `None` when there is no usable `traceparent`. A version
    /// other than 00 is read as 00 when it is followed by the fields 00 defines (the
    /// specification's forward compatibility); version ff is invalid.
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<Self> {
        let value = traceparent.trim();
        let mut parts = value.split('-');
        let version = parts.next()?;
        let trace = parts.next()?;
        let span = parts.next()?;
        let flags = parts.next()?;
        let more = parts.next().is_some();
        if version.len() != 2 || !is_lower_hex(version) || version == "ff" {
            return None;
        }
        if version == "00" && more {
            return None;
        }
        let trace_id = TraceId(decode_hex::<16>(trace)?);
        let span_id = SpanId(decode_hex::<8>(span)?);
        let [flags] = decode_hex::<1>(flags)?;
        if trace_id.0 == [0; 16] || span_id.0 == [0; 8] {
            return None;
        }
        let state = tracestate
            .map(str::trim)
            .filter(|s| !s.is_empty() && s.len() <= 512)
            .map(str::to_string);
        Some(Self {
            trace_id,
            span_id,
            sampled: flags & 1 == 1,
            state,
        })
    }
}

fn is_lower_hex(s: &str) -> bool {
    s.bytes()
        .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

fn decode_hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !is_lower_hex(s) {
        return None;
    }
    let mut out = [0; N];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_traceparent_is_read_as_the_w3c_specification_writes_it() {
        let p = TraceParent::parse(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            Some("congo=t61rcWkgMzE"),
        )
        .unwrap();
        assert_eq!(p.trace_id.to_string(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(p.span_id.to_string(), "00f067aa0ba902b7");
        assert!(p.sampled);
        assert_eq!(p.state.as_deref(), Some("congo=t61rcWkgMzE"));
        let unsampled = TraceParent::parse(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00",
            None,
        );
        assert!(!unsampled.unwrap().sampled);
        // A later version with more fields is read by 00's rules.
        assert!(TraceParent::parse(
            "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            None
        )
        .is_some());
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",
        ] {
            assert_eq!(TraceParent::parse(bad, None), None, "{bad:?}");
        }
    }
}

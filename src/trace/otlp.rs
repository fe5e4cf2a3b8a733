//! Spans as OTLP carries them: an `ExportTraceServiceRequest` of the OpenTelemetry
//! protocol (opentelemetry-proto's `collector/trace/v1`), in its binary protobuf form
//! (`http/protobuf`, the specification's default) or its JSON form (`http/json`). The
//! few messages celer sends are written by hand: a resource, one instrumentation scope,
//! spans with attributes and a status. tests/otlp_receiver.py decodes them with the
//! OpenTelemetry project's own generated classes.

use std::borrow::Cow;

use serde_json::{json, Value as Json};

use super::context::{hex, SpanId, TraceId};

/// An attribute's value (OTLP's `AnyValue`, the kinds celer uses).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Str(Cow<'static, str>),
    Int(i64),
    Bool(bool),
    Double(f64),
}

pub type Attribute = (Cow<'static, str>, Value);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpanKind {
    Internal = 1,
    Server = 2,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Status {
    Unset = 0,
    Error = 2,
}

/// One finished span.
#[derive(Debug, Clone, PartialEq)]
pub struct SpanRecord {
    pub trace_id: TraceId,
    pub span_id: SpanId,
    pub parent: Option<SpanId>,
    pub trace_state: Option<String>,
    pub name: Cow<'static, str>,
    pub kind: SpanKind,
    pub start_unix_ns: u64,
    pub end_unix_ns: u64,
    pub attributes: Vec<Attribute>,
    pub status: Status,
}

/// What every span of this process is part of: `service.name` and the rest of the
/// resource's attributes.
#[derive(Debug, Clone, PartialEq)]
pub struct Resource {
    pub attributes: Vec<Attribute>,
}

const SCOPE: &str = "celer";
const SCOPE_VERSION: &str = env!("CARGO_PKG_VERSION");

// ---- protobuf ----

/// The wire format's pieces: a field's key, varints, fixed 64-bit numbers and
/// length-delimited fields (strings, bytes, nested messages).
struct Pb(Vec<u8>);

impl Pb {
    fn varint(&mut self, mut v: u64) {
        while v >= 0x80 {
            self.0.push((v as u8) | 0x80);
            v >>= 7;
        }
        self.0.push(v as u8);
    }

    fn key(&mut self, field: u32, wire: u8) {
        self.varint(u64::from(field) << 3 | u64::from(wire));
    }

    fn bytes(&mut self, field: u32, b: &[u8]) {
        self.key(field, 2);
        self.varint(b.len() as u64);
        self.0.extend_from_slice(b);
    }

    fn string(&mut self, field: u32, s: &str) {
        self.bytes(field, s.as_bytes());
    }

    fn fixed64(&mut self, field: u32, v: u64) {
        self.key(field, 1);
        self.0.extend_from_slice(&v.to_le_bytes());
    }

    fn uint(&mut self, field: u32, v: u64) {
        self.key(field, 0);
        self.varint(v);
    }

    fn message(&mut self, field: u32, write: impl FnOnce(&mut Pb)) {
        let mut inner = Pb(Vec::new());
        write(&mut inner);
        self.bytes(field, &inner.0);
    }
}

fn pb_attribute(pb: &mut Pb, field: u32, (key, value): &Attribute) {
    pb.message(field, |kv| {
        kv.string(1, key);
        kv.message(2, |any| match value {
            Value::Str(s) => any.string(1, s),
            Value::Bool(b) => any.uint(2, u64::from(*b)),
            // int64 on the wire: two's complement in a varint.
            Value::Int(i) => any.uint(3, *i as u64),
            Value::Double(d) => any.fixed64(4, d.to_bits()),
        });
    });
}

/// `ExportTraceServiceRequest` { resource_spans: [ { resource, scope_spans: [ { scope,
/// spans } ] } ] }, binary.
pub fn encode_protobuf(resource: &Resource, spans: &[SpanRecord]) -> Vec<u8> {
    let mut request = Pb(Vec::new());
    request.message(1, |rs| {
        rs.message(1, |r| {
            for a in &resource.attributes {
                pb_attribute(r, 1, a);
            }
        });
        rs.message(2, |ss| {
            ss.message(1, |scope| {
                scope.string(1, SCOPE);
                scope.string(2, SCOPE_VERSION);
            });
            for span in spans {
                ss.message(2, |s| {
                    s.bytes(1, &span.trace_id.0);
                    s.bytes(2, &span.span_id.0);
                    if let Some(state) = &span.trace_state {
                        s.string(3, state);
                    }
                    if let Some(parent) = span.parent {
                        s.bytes(4, &parent.0);
                    }
                    s.string(5, &span.name);
                    s.uint(6, span.kind as u64);
                    s.fixed64(7, span.start_unix_ns);
                    s.fixed64(8, span.end_unix_ns);
                    for a in &span.attributes {
                        pb_attribute(s, 9, a);
                    }
                    s.message(15, |status| {
                        if span.status != Status::Unset {
                            status.uint(3, span.status as u64);
                        }
                    });
                });
            }
        });
    });
    request.0
}

// ---- JSON ----

fn json_attribute((key, value): &Attribute) -> Json {
    let value = match value {
        Value::Str(s) => json!({ "stringValue": s }),
        Value::Bool(b) => json!({ "boolValue": b }),
        // OTLP/JSON writes 64-bit integers as strings (protobuf's JSON mapping).
        Value::Int(i) => json!({ "intValue": i.to_string() }),
        Value::Double(d) => json!({ "doubleValue": d }),
    };
    json!({ "key": key, "value": value })
}

/// The same request in OTLP/JSON: field names in lowerCamelCase, ids in hex (not
/// protobuf's base64: the OTLP specification's exception), enums as numbers.
pub fn encode_json(resource: &Resource, spans: &[SpanRecord]) -> Vec<u8> {
    let spans: Vec<Json> = spans
        .iter()
        .map(|span| {
            let mut s = json!({
                "traceId": span.trace_id.to_string(),
                "spanId": span.span_id.to_string(),
                "name": span.name,
                "kind": span.kind as u8,
                "startTimeUnixNano": span.start_unix_ns.to_string(),
                "endTimeUnixNano": span.end_unix_ns.to_string(),
                "attributes": span.attributes.iter().map(json_attribute).collect::<Vec<_>>(),
                "status": if span.status == Status::Unset { json!({}) } else { json!({ "code": span.status as u8 }) },
            });
            if let Some(parent) = span.parent {
                s["parentSpanId"] = Json::String(hex(&parent.0));
            }
            if let Some(state) = &span.trace_state {
                s["traceState"] = Json::String(state.clone());
            }
            s
        })
        .collect();
    let request = json!({
        "resourceSpans": [{
            "resource": {
                "attributes": resource.attributes.iter().map(json_attribute).collect::<Vec<_>>(),
            },
            "scopeSpans": [{
                "scope": { "name": SCOPE, "version": SCOPE_VERSION },
                "spans": spans,
            }],
        }],
    });
    request.to_string().into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn varints_and_keys_are_protobufs() {
        let mut pb = Pb(Vec::new());
        pb.varint(1);
        pb.varint(300);
        pb.varint(u64::MAX);
        assert_eq!(
            pb.0,
            [1, 0xac, 0x02, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]
        );
        let mut pb = Pb(Vec::new());
        pb.string(5, "ab");
        pb.fixed64(7, 1);
        assert_eq!(pb.0, [0x2a, 2, b'a', b'b', 0x39, 1, 0, 0, 0, 0, 0, 0, 0]);
    }
}

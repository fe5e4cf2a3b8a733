"""An OTLP/HTTP trace receiver for tests/otlp.rs: listens on 127.0.0.1 (a free port,
printed first as `listening PORT`), decodes each POST to /v1/traces with the
OpenTelemetry project's own generated classes (opentelemetry-proto, in .venv from
scripts/requirements.txt) and prints every span as one JSON line. A body that does not
decode is answered 400 and printed as an `error` line, so that the test sees it.

    python tests/otlp_receiver.py
"""

import base64
import json
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

ID_FIELDS = ("traceId", "spanId", "parentSpanId")


def from_json(body: bytes) -> ExportTraceServiceRequest:
    """OTLP/JSON writes ids in hex where protobuf's JSON mapping has base64: the
    specification's one exception, undone here before a strict parse."""
    doc = json.loads(body)
    for rs in doc.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for field in ID_FIELDS:
                    if field in span:
                        span[field] = base64.b64encode(bytes.fromhex(span[field])).decode()
    return json_format.ParseDict(doc, ExportTraceServiceRequest())


def value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def emit(line: dict) -> None:
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


class Receiver(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (the standard library's name)
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        content_type = self.headers.get("Content-Type", "")
        try:
            if self.path != "/v1/traces":
                raise ValueError(f"POST to {self.path}, not /v1/traces")
            if content_type == "application/x-protobuf":
                request = ExportTraceServiceRequest.FromString(body)
                answer, answer_type = (
                    ExportTraceServiceResponse().SerializeToString(),
                    "application/x-protobuf",
                )
            elif content_type == "application/json":
                request = from_json(body)
                answer, answer_type = b"{}", "application/json"
            else:
                raise ValueError(f"Content-Type {content_type!r}")
        except Exception as e:  # every failure is the test's to see
            emit({"error": f"{type(e).__name__}: {e}"})
            self.send_response(400)
            self.end_headers()
            return
        for rs in request.resource_spans:
            resource = {a.key: value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    emit(
                        {
                            "content_type": content_type,
                            "resource": resource,
                            "scope": ss.scope.name,
                            "trace_id": s.trace_id.hex(),
                            "span_id": s.span_id.hex(),
                            "parent_span_id": s.parent_span_id.hex(),
                            "trace_state": s.trace_state,
                            "name": s.name,
                            "kind": s.kind,
                            "start": s.start_time_unix_nano,
                            "end": s.end_time_unix_nano,
                            "attributes": {a.key: value(a.value) for a in s.attributes},
                            "status": s.status.code,
                        }
                    )
        self.send_response(200)
        self.send_header("Content-Type", answer_type)
        self.send_header("Content-Length", str(len(answer)))
        self.end_headers()
        self.wfile.write(answer)

    def log_message(self, *args):
        pass


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    emit({"listening": server.server_address[1]})
    server.serve_forever()


if __name__ == "__main__":
    main()

"""An OTLP/HTTP trace receiver on loopback, for tests and benchmarks: it
decodes each request with the official opentelemetry-proto messages and
keeps the spans."""

import gzip
import http.server
import threading

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2


class Receiver:
    """An OTLP/HTTP trace receiver on loopback: decodes each request with
    the official proto messages and keeps the spans."""

    def __init__(self):
        self.spans = []
        received = self.spans

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                for rs in request.resource_spans:
                    service = {a.key: a.value.string_value for a in rs.resource.attributes}
                    for ss in rs.scope_spans:
                        received.extend((service, span) for span in ss.spans)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

"""The router's OpenTelemetry span per request: it continues the caller's W3C `traceparent`, and its own context
goes to the replica as `traceparent`, so that the replica's `llm_request` span (tokenmill/api/tracing.py) is
its child and one trace shows routing, failover and generation. The exporter, endpoint rules and resource are
the server's (RequestTracer); unlike the server, the router opens its span on arrival, because the replica needs
its id before the request leaves."""
from __future__ import annotations

from tokenmill.api.tracing import RequestTracer, make_tracer


class RouterTracer:
    def __init__(self, tracer: RequestTracer):
        self.tracer = tracer

    def start(self, route: str, headers) -> object:
        from opentelemetry.trace import SpanKind
        context = self.tracer.propagator.extract({k.lower(): v for k, v in headers.items()})
        return self.tracer.tracer.start_span(f"router {route}", context=context, kind=SpanKind.SERVER)

    def inject(self, span, headers: dict[str, str]) -> None:
        """Sets traceparent (and tracestate) in `headers` to the span's context, for the replica."""
        from opentelemetry.trace import set_span_in_context
        for name in [k for k in headers if k.lower() in ("traceparent", "tracestate")]:
            del headers[name]
        self.tracer.propagator.inject(headers, context=set_span_in_context(span))

    @staticmethod
    def end(span, attributes: dict) -> None:
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        span.end()

    def shutdown(self) -> None:
        self.tracer.shutdown()


def make_router_tracer(endpoint_flag: str | None) -> RouterTracer | None:
    tracer = make_tracer(endpoint_flag, include_text=False)
    return RouterTracer(tracer) if tracer else None

"""OpenTelemetry: one span per request, with the GenAI semantic-convention attributes and the engine's latency
breakdown, exported over OTLP/HTTP. Off unless --otlp-traces-endpoint or OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT
is set. The span continues the caller's W3C `traceparent`. Prompt and completion text are recorded only with
--otlp-traces-include-text.

The span is written when the request ends, with its start set back to the request's arrival, so that nothing
runs on the request path while it is served; a batch processor exports spans from a background thread."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

from tokenmill import envs

logger = logging.getLogger("tokenmill.api.tracing")


@dataclass
class RequestTrace:
    """What a finished request leaves for its span. Times are time.monotonic(); 0 means never reached."""
    request_id: str
    operation: str  # "text_completion" | "chat"
    model: str
    headers: dict[str, str]  # the incoming request's, for traceparent / tracestate
    max_tokens: int | None
    temperature: float
    top_p: float
    n: int
    input_tokens: int = 0
    user: str | None = None  # OpenAI's `user`: the client's id for its end user
    output_tokens: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    arrival: float = 0.0
    first_scheduled: float = 0.0
    first_token: float = 0.0
    finished: float = 0.0
    prompt_text: str | None = None
    completion_text: str | None = None


def _traces_endpoint(flag: str | None) -> str | None:
    if flag:
        return flag if urlparse(flag).path not in ("", "/") else flag.rstrip("/") + "/v1/traces"
    if envs.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT:
        return envs.OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
    if envs.OTEL_EXPORTER_OTLP_ENDPOINT:
        return envs.OTEL_EXPORTER_OTLP_ENDPOINT.rstrip("/") + "/v1/traces"
    return None


class RequestTracer:
    def __init__(self, endpoint: str, include_text: bool):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES still apply: Resource.create merges them in.
        resource = Resource.create({"service.name": envs.OTEL_SERVICE_NAME})
        self.provider = TracerProvider(resource=resource)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("tokenmill")
        self.propagator = TraceContextTextMapPropagator()
        self.include_text = include_text
        logger.info("exporting OpenTelemetry traces to %s", endpoint)

    def record(self, t: RequestTrace) -> None:
        from opentelemetry.trace import SpanKind

        now_mono, now_ns = time.monotonic(), time.time_ns()

        def wall_ns(mono: float) -> int:
            return now_ns - int((now_mono - mono) * 1e9)

        end = t.finished or now_mono
        span = self.tracer.start_span("llm_request", context=self.propagator.extract(t.headers),
                                      kind=SpanKind.SERVER, start_time=wall_ns(t.arrival or end))
        attrs = {
            "gen_ai.operation.name": t.operation, "gen_ai.system": "tokenmill",
            "gen_ai.request.model": t.model, "gen_ai.response.model": t.model, "gen_ai.response.id": t.request_id,
            "gen_ai.request.temperature": t.temperature, "gen_ai.request.top_p": t.top_p, "gen_ai.request.n": t.n,
            "gen_ai.usage.input_tokens": t.input_tokens, "gen_ai.usage.output_tokens": t.output_tokens,
            "gen_ai.response.finish_reasons": t.finish_reasons,
        }
        if t.max_tokens is not None:
            attrs["gen_ai.request.max_tokens"] = t.max_tokens
        if t.user is not None:  # OpenTelemetry's attribute for the end user's id
            attrs["user.id"] = t.user
        if t.arrival:
            attrs["gen_ai.latency.e2e"] = end - t.arrival
            if t.first_scheduled:
                attrs["gen_ai.latency.time_in_queue"] = t.first_scheduled - t.arrival
            if t.first_token:
                attrs["gen_ai.latency.time_to_first_token"] = t.first_token - t.arrival
        if t.first_scheduled and t.first_token:
            attrs["gen_ai.latency.time_in_model_prefill"] = t.first_token - t.first_scheduled
            attrs["gen_ai.latency.time_in_model_decode"] = end - t.first_token
        if self.include_text:
            if t.prompt_text is not None:
                attrs["gen_ai.prompt"] = t.prompt_text
            if t.completion_text is not None:
                attrs["gen_ai.completion"] = t.completion_text
        span.set_attributes(attrs)
        span.end(end_time=wall_ns(end))

    def shutdown(self) -> None:
        self.provider.shutdown()  # flushes what is still batched


def make_tracer(endpoint_flag: str | None, include_text: bool) -> RequestTracer | None:
    endpoint = _traces_endpoint(endpoint_flag)
    return RequestTracer(endpoint, include_text) if endpoint else None

//! OpenTelemetry export of the node's spans over OTLP/gRPC (the `otel`
//! feature). On only when `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; the exporter reads the
//! other standard `OTEL_*` variables itself (`OTEL_SERVICE_NAME`,
//! `OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT`, ...).
//!
//! The spans that continue a W3C trace (a node's `request` span, a
//! participant's `rpc` span) are tied to the caller's span through
//! [`dtx_client::trace::SpanExport`]: the exported span gets the caller's
//! trace id and span as its parent, and the ids the exporter gave it are
//! the ones propagated onward, so the exported tree and the `traceparent`
//! headers agree. A grouped participant message's span is linked to every
//! item's trace.

use std::str::FromStr;
use std::sync::OnceLock;

use dtx_client::trace::TraceContext;
use opentelemetry::trace::SpanContext;
use opentelemetry::trace::SpanId;
use opentelemetry::trace::TraceContextExt;
use opentelemetry::trace::TraceFlags;
use opentelemetry::trace::TraceId;
use opentelemetry::trace::TraceState;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The exporter's own runtime (one thread): the OTLP client runs there,
/// apart from the node's runtime, for the life of the process.
static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
static PROVIDER: OnceLock<SdkTracerProvider> = OnceLock::new();

/// The tracing layer that exports spans, when `OTEL_EXPORTER_OTLP_ENDPOINT`
/// (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; `None` otherwise, or
/// when the exporter cannot be built (said on stderr: logging is not up
/// yet).
pub fn layer<S>() -> Option<tracing_opentelemetry::OpenTelemetryLayer<S, opentelemetry_sdk::trace::Tracer>>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    let on = ["OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()));
    if !on {
        return None;
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("otel-export")
        .enable_all()
        .build()
    {
        Ok(rt) => RUNTIME.get_or_init(|| rt),
        Err(e) => {
            eprintln!("OpenTelemetry export off: no runtime for the exporter: {e}");
            return None;
        }
    };
    // The gRPC client is built inside the exporter's runtime, where its
    // connection tasks then run.
    let exporter = {
        let _in_rt = rt.enter();
        opentelemetry_otlp::SpanExporter::builder().with_tonic().build()
    };
    let exporter = match exporter {
        Ok(e) => e,
        Err(e) => {
            eprintln!("OpenTelemetry export off: the OTLP exporter could not be built: {e}");
            return None;
        }
    };
    let service = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| "dtx-coordinator".into());
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name(service)
                .build(),
        )
        .build();
    let tracer = provider.tracer("dtx");
    let _ = PROVIDER.set(provider);
    dtx_client::trace::set_span_export(Box::new(OtelExport));
    Some(tracing_opentelemetry::layer().with_tracer(tracer))
}

/// Sends the spans not exported yet (call before the process exits).
pub fn shutdown() {
    if let Some(p) = PROVIDER.get() {
        if let Err(e) = p.shutdown() {
            eprintln!("OpenTelemetry export: shutdown: {e}");
        }
    }
}

/// The remote span context of `ctx` (the caller's span).
fn span_context(ctx: &TraceContext) -> SpanContext {
    SpanContext::new(
        TraceId::from_bytes(ctx.trace_id.to_be_bytes()),
        SpanId::from_bytes(ctx.span_id.to_be_bytes()),
        TraceFlags::new(ctx.flags),
        true,
        ctx.state
            .as_deref()
            .and_then(|s| TraceState::from_str(s).ok())
            .unwrap_or_default(),
    )
}

struct OtelExport;

impl dtx_client::trace::SpanExport for OtelExport {
    fn opened(&self, span: &tracing::Span, remote: Option<&TraceContext>) -> Option<(u128, u64)> {
        if let Some(r) = remote {
            let _ = span.set_parent(opentelemetry::Context::new().with_remote_span_context(span_context(r)));
        }
        let cx = span.context();
        let sc = cx.span().span_context().clone();
        sc.is_valid().then(|| {
            (
                u128::from_be_bytes(sc.trace_id().to_bytes()),
                u64::from_be_bytes(sc.span_id().to_bytes()),
            )
        })
    }

    fn link(&self, span: &tracing::Span, other: &TraceContext) {
        span.add_link(span_context(other));
    }
}

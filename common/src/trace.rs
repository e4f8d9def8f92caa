//! One trace per transaction, from the client through the cluster's nodes
//! to the participants (W3C Trace Context, [`dtx_proto::trace`]).
//!
//! A [`TraceContext`] names a trace and the span the running code works
//! in. Like the txid of `dtx_client::propagate`, it is a tokio task-local:
//! [`scope`] makes a context current, [`current`] reads it, and every call
//! the running code makes through the `dtx_client::Client` or a channel
//! wrapped by `dtx_client::propagate::OutboundTxidLayer` carries it in the
//! `traceparent` (and `tracestate`) metadata, the current span being the
//! callee's parent.
//!
//! - **Client.** `Client::begin` (and `begin_and_commit`) starts a trace
//!   for the transaction, or continues the current one when the
//!   application calls it inside [`scope`]; the client remembers the
//!   transaction's trace, so every later call about that txid (Enlist,
//!   Commit, Abort, decision and status reads) carries it, wherever it is
//!   made (`Client::trace_of`).
//! - **Servers.** A node (per request) and a participant built on the SDK
//!   (per call, through `dtx_client::propagate::InboundTxidLayer`) open a
//!   `tracing` span with the fields `txid` and `trace_id` (and `span_id`),
//!   continue the caller's trace in it ([`continue_in`]; a request without
//!   a valid `traceparent` starts a new trace), and make it current while
//!   the handler runs, so calls it makes (a node forwarding to the leader,
//!   the leader's driver calling participants) carry it on.
//! - **Export.** Without an exporter, the ids are random and live in the
//!   log lines' span fields only. A process that exports spans (the `dtx`
//!   binary built with the `otel` feature) installs a [`SpanExport`], which
//!   ties each server span to the caller's span and hands back the ids it
//!   gave the span, so what is exported and what is propagated agree.

use std::future::Future;
use std::sync::OnceLock;

use dtx_proto::trace::TraceParent;
use dtx_proto::trace::FLAG_SAMPLED;
use tonic::metadata::MetadataMap;

tokio::task_local! {
    /// The trace and span the running code works in.
    static TRACE: Option<TraceContext>;
}

/// A trace and the span that the code holding it works in: what a call it
/// makes sends as `traceparent` (the span id becomes the callee's parent
/// id) and `tracestate`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TraceContext {
    /// The trace id (never zero).
    pub trace_id: u128,
    /// The id of the span the holder works in (never zero).
    pub span_id: u64,
    /// W3C trace flags (bit 0: sampled).
    pub flags: u8,
    /// The vendors' `tracestate`, passed on untouched.
    pub state: Option<String>,
}

fn nonzero_u128() -> u128 {
    loop {
        let v: u128 = rand::random();
        if v != 0 {
            return v;
        }
    }
}

fn nonzero_u64() -> u64 {
    loop {
        let v: u64 = rand::random();
        if v != 0 {
            return v;
        }
    }
}

impl TraceContext {
    /// A new trace (random ids, sampled).
    pub fn new_root() -> TraceContext {
        TraceContext {
            trace_id: nonzero_u128(),
            span_id: nonzero_u64(),
            flags: FLAG_SAMPLED,
            state: None,
        }
    }

    /// The context a caller sent: its `traceparent` header value (and
    /// `tracestate`, if any). `None` when `traceparent` is not valid W3C.
    pub fn from_traceparent(traceparent: &str, tracestate: Option<&str>) -> Option<TraceContext> {
        TraceParent::parse(traceparent).map(|p| TraceContext::from_parent(p, tracestate.map(str::to_string)))
    }

    fn from_parent(p: TraceParent, state: Option<String>) -> TraceContext {
        TraceContext {
            trace_id: p.trace_id,
            span_id: p.parent_id,
            flags: p.flags,
            state,
        }
    }

    /// The context a request's metadata carries, if valid
    /// ([`dtx_proto::trace::trace_of`]).
    pub fn from_metadata(md: &MetadataMap) -> Option<TraceContext> {
        TraceContext::from_headers(md.as_ref())
    }

    /// The context raw HTTP headers carry, if valid.
    pub fn from_headers(headers: &http::HeaderMap) -> Option<TraceContext> {
        dtx_proto::trace::trace_of(headers).map(|(p, s)| TraceContext::from_parent(p, s))
    }

    /// A span of the same trace whose parent is this one (a new span id).
    pub fn child(&self) -> TraceContext {
        TraceContext {
            span_id: nonzero_u64(),
            ..self.clone()
        }
    }

    /// The `traceparent` a call made in this span sends.
    pub fn traceparent(&self) -> TraceParent {
        TraceParent {
            trace_id: self.trace_id,
            parent_id: self.span_id,
            flags: self.flags,
        }
    }

    /// Puts `traceparent` and `tracestate` into `md` (replacing any).
    pub fn attach(&self, md: &mut MetadataMap) {
        self.attach_headers(md.as_mut());
    }

    /// Puts `traceparent` and `tracestate` into raw HTTP headers.
    pub fn attach_headers(&self, headers: &mut http::HeaderMap) {
        dtx_proto::trace::attach_trace(headers, &self.traceparent(), self.state.as_deref());
    }

    /// The trace id as 32 lowercase hex digits, as log lines show it.
    pub fn trace_id_hex(&self) -> String {
        format!("{:032x}", self.trace_id)
    }

    /// The span id as 16 lowercase hex digits.
    pub fn span_id_hex(&self) -> String {
        format!("{:016x}", self.span_id)
    }
}

/// Runs `fut` with `ctx` as its current trace context ([`current`]). Scopes
/// nest: the innermost wins.
pub async fn scope<F: Future>(ctx: TraceContext, fut: F) -> F::Output {
    TRACE.scope(Some(ctx), fut).await
}

/// Runs `fut` with `ctx` (possibly none) as its current trace context
/// (what the client and its layers use for a transaction whose trace may
/// not be known).
pub fn scope_opt<F: Future>(
    ctx: Option<TraceContext>,
    fut: F,
) -> tokio::task::futures::TaskLocalFuture<Option<TraceContext>, F> {
    TRACE.scope(ctx, fut)
}

/// Runs `f` with `ctx` (possibly none) as its current trace context.
pub fn sync_scope_opt<R>(ctx: Option<TraceContext>, f: impl FnOnce() -> R) -> R {
    TRACE.sync_scope(ctx, f)
}

/// The current trace context, if any (set by [`scope`], by a server's
/// request span, or by [`with_current`]).
pub fn current() -> Option<TraceContext> {
    TRACE.try_with(|t| t.clone()).ok().flatten()
}

/// `fut` bound to the trace context current now (for `tokio::spawn`, whose
/// task does not inherit task-locals).
pub fn with_current<F: Future>(fut: F) -> impl Future<Output = F::Output> {
    TRACE.scope(current(), fut)
}

/// What a process that exports spans (OpenTelemetry, say) plugs in: it is
/// told of every server span opened for a trace and of the other traces a
/// span works for.
pub trait SpanExport: Send + Sync + 'static {
    /// `span` was opened to continue `remote` (the caller's context; `None`
    /// for a new trace). Returns the (trace id, span id) the exporter gave
    /// the span, which then replace the random ones, so that calls made from
    /// it name the exported span as their parent; `None` keeps them.
    fn opened(&self, span: &tracing::Span, remote: Option<&TraceContext>) -> Option<(u128, u64)>;

    /// `span` also works for the transaction traced by `other` (a grouped
    /// message to a participant carries many transactions): a link.
    fn link(&self, span: &tracing::Span, other: &TraceContext);
}

static EXPORT: OnceLock<Box<dyn SpanExport>> = OnceLock::new();

/// Installs the process's span exporter (once; `false` if one was already
/// installed).
pub fn set_span_export(export: Box<dyn SpanExport>) -> bool {
    EXPORT.set(export).is_ok()
}

/// Continues `remote` (the context a request carried, or `None`: a new
/// trace) in `span`: returns the context of `span` (the same trace, its own
/// span id) and records its `trace_id` and `span_id` in the span's fields
/// of those names (declare them `tracing::field::Empty`). With a
/// [`SpanExport`] installed, the ids are the exporter's.
pub fn continue_in(span: &tracing::Span, remote: Option<&TraceContext>) -> TraceContext {
    let mut ctx = match remote {
        Some(r) => r.child(),
        None => TraceContext::new_root(),
    };
    if let Some((trace_id, span_id)) = EXPORT.get().and_then(|e| e.opened(span, remote)) {
        if trace_id != 0 && span_id != 0 {
            ctx.trace_id = trace_id;
            ctx.span_id = span_id;
        }
    }
    span.record("trace_id", ctx.trace_id_hex());
    span.record("span_id", ctx.span_id_hex());
    ctx
}

/// Tells the exporter, if any, that `span` works for `other` too.
pub fn link(span: &tracing::Span, other: &TraceContext) {
    if let Some(e) = EXPORT.get() {
        e.link(span, other);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_context_round_trips_through_metadata_and_children_keep_the_trace() {
        let ctx = TraceContext::from_traceparent(
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            Some("rojo=00f067aa0ba902b7"),
        )
        .unwrap();
        assert_eq!(ctx.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(ctx.span_id_hex(), "00f067aa0ba902b7");
        let mut md = MetadataMap::new();
        ctx.attach(&mut md);
        assert_eq!(TraceContext::from_metadata(&md), Some(ctx.clone()));
        let child = ctx.child();
        assert_eq!(
            (child.trace_id, child.flags, &child.state),
            (ctx.trace_id, 1, &ctx.state)
        );
        assert_ne!(child.span_id, ctx.span_id);
        assert_ne!(child.span_id, 0);
        assert_eq!(TraceContext::from_traceparent("00-bad", None), None);
        let root = TraceContext::new_root();
        assert_ne!(root.trace_id, 0);
        assert_ne!(root.span_id, 0);
    }

    #[tokio::test]
    async fn scope_sets_the_current_context_and_continue_in_records_the_ids() {
        assert_eq!(current(), None);
        let ctx = TraceContext::new_root();
        scope(ctx.clone(), async {
            assert_eq!(current(), Some(ctx.clone()));
            let inner = tokio::spawn(with_current(async { current() })).await.unwrap();
            assert_eq!(inner, Some(ctx.clone()));
            let bare = tokio::spawn(async { current() }).await.unwrap();
            assert_eq!(bare, None);
        })
        .await;
        let span = tracing::info_span!("t", trace_id = tracing::field::Empty, span_id = tracing::field::Empty);
        let mine = continue_in(&span, Some(&ctx));
        assert_eq!(mine.trace_id, ctx.trace_id);
        assert_ne!(mine.span_id, ctx.span_id);
        let fresh = continue_in(&span, None);
        assert_ne!(fresh.trace_id, ctx.trace_id);
    }
}

//! Prometheus metrics: the engine's statistics in the text exposition format (version 0.0.4),
//! served at `/metrics` over plain HTTP/1.1 on `--metrics-port`. Every name starts with `tandem_`
//! and ends with its unit.

use crate::service::State;
use std::fmt::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use tandem_engine::stats::Histogram;
use tandem_engine::Stats;

const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

fn header(out: &mut String, name: &str, kind: &str, help: &str) {
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

fn scalar(out: &mut String, name: &str, kind: &str, help: &str, v: f64) {
    header(out, name, kind, help);
    let _ = writeln!(out, "{name} {v}");
}

fn histogram(out: &mut String, name: &str, help: &str, h: &Histogram) {
    header(out, name, "histogram", help);
    let cumulative = h.cumulative();
    for (b, c) in h.bounds().iter().zip(&cumulative) {
        let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
    }
    let total = cumulative.last().copied().unwrap_or(0);
    let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {total}");
    let _ = writeln!(out, "{name}_sum {}", h.sum());
    let _ = writeln!(out, "{name}_count {total}");
}

/// The exposition text; before the model is ready only `tandem_model_ready 0`.
pub fn render(state: &State) -> String {
    let mut out = String::new();
    let Some(engine) = state.engine_handle() else {
        scalar(&mut out, "tandem_model_ready", "gauge", "1 once the model is loaded and warmed up.", 0.0);
        return out;
    };
    scalar(&mut out, "tandem_model_ready", "gauge", "1 once the model is loaded and warmed up.", 1.0);
    let s: &Stats = engine.stats();
    let o = &mut out;
    histogram(
        o,
        "tandem_time_to_first_token_seconds",
        "Time from arrival to the first generated token.",
        &s.time_to_first_token,
    );
    histogram(o, "tandem_inter_token_latency_seconds", "Time between two tokens of one stream.", &s.inter_token);
    histogram(o, "tandem_request_duration_seconds", "Time from arrival to the end of a request.", &s.end_to_end);
    histogram(o, "tandem_queue_time_seconds", "Time a request waited for a slot.", &s.queue_time);
    let counters = [
        ("tandem_prompt_tokens_total", "Prompt tokens of admitted requests.", &s.prompt_tokens),
        ("tandem_cached_prompt_tokens_total", "Prompt tokens reused from the prompt cache.", &s.cached_prompt_tokens),
        ("tandem_generated_tokens_total", "Tokens generated.", &s.generated_tokens),
        ("tandem_requests_finished_total", "Requests that ended with a finish reason.", &s.requests_finished),
        ("tandem_requests_cancelled_total", "Requests aborted or whose client went away.", &s.requests_cancelled),
        ("tandem_requests_failed_total", "Requests that failed (deadline, shutdown, internal).", &s.requests_failed),
        ("tandem_requests_rejected_total", "Requests refused because the queue was full.", &s.requests_rejected),
        ("tandem_decode_steps_total", "Batches decoded.", &s.steps),
        ("tandem_prompt_cache_divergences_total", "Prompts that diverged from a cached prefix.", &s.cache_divergences),
        (
            "tandem_chat_templates_rendered_total",
            "Chat prompts rendered with the chat template.",
            &s.templates_rendered,
        ),
    ];
    for (name, help, c) in counters {
        scalar(o, name, "counter", help, c.get() as f64);
    }
    histogram(
        o,
        "tandem_prompt_cache_divergence_position_tokens",
        "Token position where prompts diverged from a cached prefix.",
        &s.cache_divergence_position,
    );
    let g = |o: &mut String, name: &str, help: &str, v: f64| scalar(o, name, "gauge", help, v);
    g(o, "tandem_requests_running", "Requests in a slot.", s.running.get() as f64);
    g(o, "tandem_requests_waiting", "Requests waiting for a slot.", s.waiting.get() as f64);
    g(o, "tandem_kv_cache_usage_ratio", "Share of the KV cache positions in use.", s.kv_usage_ratio());
    g(o, "tandem_prompt_cache_hit_ratio", "Share of prompt tokens reused from the cache.", s.prompt_cache_hit_ratio());
    g(o, "tandem_slots", "Slots (-np).", engine.config().n_parallel as f64);
    device_ledgers(o, &s.device_counts());
    if let Some(c) = state.conn_stats() {
        connections(o, c);
    }
    out
}

/// Each port's connections: open now, accepted, refused at the cap, closed to make room or for
/// sending nothing in time.
fn connections(o: &mut String, stats: &crate::ServerStats) {
    let ports = [("grpc", &stats.grpc), ("http", &stats.http), ("metrics", &stats.metrics)];
    header(o, "tandem_connections_open", "gauge", "Open connections, by port.");
    for (port, c) in ports {
        let _ = writeln!(o, "tandem_connections_open{{port=\"{port}\"}} {}", c.open.load(Ordering::Relaxed));
    }
    header(o, "tandem_connections_total", "counter", "Connections by port and what became of them.");
    for (port, c) in ports {
        for (what, n) in
            [("accepted", &c.accepted), ("refused", &c.refused), ("evicted", &c.evicted), ("timed_out", &c.timed_out)]
        {
            let _ = writeln!(
                o,
                "tandem_connections_total{{port=\"{port}\",outcome=\"{what}\"}} {}",
                n.load(Ordering::Relaxed)
            );
        }
    }
}

/// Each device's launches, copies (each way, with bytes) and host waits since the start, labeled
/// by device (`CPU`, `CUDA0`, ...).
fn device_ledgers(o: &mut String, devices: &[(String, tandem_engine::Counts)]) {
    if devices.is_empty() {
        return;
    }
    let each = |o: &mut String, name: &str, help: &str, v: &dyn Fn(&tandem_engine::Counts) -> u64| {
        header(o, name, "counter", help);
        for (dev, c) in devices {
            let _ = writeln!(o, "{name}{{device=\"{dev}\"}} {}", v(c));
        }
    };
    let both = |o: &mut String, name: &str, help: &str, v: &dyn Fn(&tandem_engine::Counts) -> (u64, u64)| {
        header(o, name, "counter", help);
        for (dev, c) in devices {
            let (up, down) = v(c);
            let _ = writeln!(o, "{name}{{device=\"{dev}\",direction=\"h2d\"}} {up}");
            let _ = writeln!(o, "{name}{{device=\"{dev}\",direction=\"d2h\"}} {down}");
        }
    };
    each(o, "tandem_device_launches_total", "Kernel launches (ops, on the CPU) by device.", &|c| c.launches);
    both(o, "tandem_device_copies_total", "Copies between the host and a device, by direction.", &|c| (c.h2d, c.d2h));
    both(o, "tandem_device_copy_bytes_total", "Bytes copied between the host and a device, by direction.", &|c| {
        (c.h2d_bytes, c.d2h_bytes)
    });
    each(o, "tandem_device_host_syncs_total", "Times the host waited for a device.", &|c| c.syncs);
}

/// `GET /metrics` (behind the API key, when keys are set).
pub(crate) async fn metrics(
    axum::extract::State(state): axum::extract::State<Arc<State>>,
    headers: axum::http::HeaderMap,
) -> axum::response::Response {
    use axum::http::{header, StatusCode};
    use axum::response::IntoResponse;
    match state.authorize(headers.get(header::AUTHORIZATION).map(|v| v.as_bytes())) {
        Ok(_) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], render(&state)).into_response(),
        Err(msg) => (StatusCode::UNAUTHORIZED, format!("{msg}\n")).into_response(),
    }
}

/// The metrics port's routes: `/metrics`.
pub(crate) fn router(state: Arc<State>) -> axum::Router {
    use axum::http::StatusCode;
    axum::Router::new()
        .route("/metrics", axum::routing::get(metrics))
        .fallback(|| async { (StatusCode::NOT_FOUND, "not found: metrics are at /metrics\n") })
        .with_state(state)
}

//! Prometheus metrics: the engine's statistics in the text exposition format (version 0.0.4),
//! served at `/metrics` over plain HTTP/1.1 on `--metrics-port`. Every name starts with `tandem_`
//! and ends with its unit.

use crate::service::State;
use http_body_util::Full;
use hyper::body::Bytes;
use hyper::{Method, Response, StatusCode};
use hyper_util::rt::TokioIo;
use std::fmt::Write;
use std::sync::Arc;
use tandem_engine::stats::Histogram;
use tandem_engine::Stats;
use tokio::net::TcpListener;

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
    let c = |o: &mut String, name: &str, help: &str, v: u64| scalar(o, name, "counter", help, v as f64);
    c(o, "tandem_prompt_tokens_total", "Prompt tokens of admitted requests.", s.prompt_tokens.get());
    c(
        o,
        "tandem_cached_prompt_tokens_total",
        "Prompt tokens reused from the prompt cache.",
        s.cached_prompt_tokens.get(),
    );
    c(o, "tandem_generated_tokens_total", "Tokens generated.", s.generated_tokens.get());
    c(o, "tandem_requests_finished_total", "Requests that ended with a finish reason.", s.requests_finished.get());
    c(o, "tandem_requests_cancelled_total", "Requests aborted or whose client went away.", s.requests_cancelled.get());
    c(
        o,
        "tandem_requests_failed_total",
        "Requests that failed (deadline, shutdown, internal).",
        s.requests_failed.get(),
    );
    c(o, "tandem_requests_rejected_total", "Requests refused because the queue was full.", s.requests_rejected.get());
    c(o, "tandem_decode_steps_total", "Batches decoded.", s.steps.get());
    c(
        o,
        "tandem_prompt_cache_divergences_total",
        "Prompts that diverged from a cached prefix.",
        s.cache_divergences.get(),
    );
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
    out
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

/// Serves `/metrics` on `listener` until the task is aborted.
pub async fn serve(listener: TcpListener, state: Arc<State>) {
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let state = state.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                let state = state.clone();
                async move {
                    let (status, body) = match (req.method(), req.uri().path()) {
                        (&Method::GET, "/metrics") => (StatusCode::OK, render(&state)),
                        (&Method::GET, _) => (StatusCode::NOT_FOUND, "not found: metrics are at /metrics\n".into()),
                        _ => (StatusCode::METHOD_NOT_ALLOWED, "only GET /metrics\n".into()),
                    };
                    let mut resp = Response::new(Full::new(Bytes::from(body)));
                    *resp.status_mut() = status;
                    if let Ok(v) = CONTENT_TYPE.parse() {
                        resp.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
                    }
                    Ok::<_, std::convert::Infallible>(resp)
                }
            });
            let _ = hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
        });
    }
}

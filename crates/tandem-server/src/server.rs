//! The running server: the inference service, `grpc.health.v1.Health` and server reflection on
//! one listener, and metrics on another. Its life: started NOT_SERVING while the model loads,
//! [`RunningServer::set_ready`] (SERVING), [`RunningServer::drain`] (NOT_SERVING, new calls
//! UNAVAILABLE, open streams finish), [`RunningServer::stop`].

use crate::conn::{self, ConnStats, Limits};
use crate::pb::inference_service_server::InferenceServiceServer;
use crate::service::{ModelDescription, Service, State};
use crate::{metrics, pb, Error, Result};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;
use tandem_engine::EngineHandle;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tonic::server::NamedService;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// The service name health checks ask about, besides "" (the whole server).
pub const SERVICE_NAME: &str = <InferenceServiceServer<Service> as NamedService>::NAME;

/// How often an idle server checks that the model's files are unchanged.
const FILE_CHECK_INTERVAL: Duration = Duration::from_millis(500);

/// How long stopping waits for answers still being written.
const STOP_GRACE: Duration = Duration::from_secs(2);

pub struct RunningServer {
    addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    state: Arc<State>,
    health: HealthReporter,
    grpc: Option<JoinHandle<()>>,
    metrics: Option<JoinHandle<()>>,
    http: Option<JoinHandle<()>>,
    limits: Limits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    stats: ServerStats,
    /// The task that turns health NOT_SERVING when the engine can no longer run.
    watch: std::sync::Mutex<Option<JoinHandle<()>>>,
}

/// How a drain ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Drained {
    /// Streams still open when the timeout passed (0 = all finished).
    pub abandoned: usize,
}

fn reflection() -> tonic_reflection::server::Builder<'static> {
    tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
}

/// How the server guards itself.
#[derive(Clone, Debug, Default)]
pub struct Options {
    /// `--api-key`s: every call but health checks must carry one (`Authorization: Bearer KEY`).
    /// None: every client is trusted (the local default).
    pub api_keys: Vec<String>,
    /// Connection limits of each port.
    pub limits: Limits,
    /// Serve TLS on every port.
    pub tls: Option<TlsFiles>,
    /// Where chat answers' thinking goes (`--reasoning-format`).
    pub reasoning_format: crate::reasoning::ReasoningFormat,
    /// What a request gets for a sampling parameter it leaves out.
    pub sampling: SamplingDefaults,
    /// `--metrics` (llama-server's): `GET /metrics` on the HTTP API's ports too.
    pub metrics_on_api: bool,
    /// `--no-slots` (llama-server's): `GET /slots` answers 501.
    pub no_slots: bool,
    /// `--slot-save-path` (llama-server's): the directory of the files `POST /slots/{id}` saves
    /// slots to and restores them from; none: those answer 501.
    pub slot_save_path: Option<std::path::PathBuf>,
}

/// What a request gets for a sampling parameter it leaves out: llama.cpp's defaults, or the
/// server's sampling flags (`tandem serve --temp 0.6 --min-p 0.01`, as llama-server).
#[derive(Clone, Debug, Default)]
pub struct SamplingDefaults {
    /// The parameters (their `seed` is not read: see `seed`).
    pub params: tandem_engine::SamplingParams,
    /// `--seed`: the seed of requests without one. None: a new seed per HTTP request (as
    /// llama-server and OpenAI), 0 over gRPC (its documented default).
    pub seed: Option<u64>,
}

/// A certificate chain and its private key, PEM (`--ssl-cert-file`, `--ssl-key-file`).
#[derive(Clone, Debug)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// The TLS acceptor for `files`, offering HTTP/2 and HTTP/1.1 by ALPN.
fn tls_acceptor(files: &TlsFiles) -> Result<tokio_rustls::TlsAcceptor> {
    use rustls_pki_types::pem::PemObject;
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let bad =
        |what: &str, path: &PathBuf, e: &dyn std::fmt::Display| Error::Tls(format!("{what} {}: {e}", path.display()));
    let certs = CertificateDer::pem_file_iter(&files.cert)
        .and_then(|it| it.collect::<std::result::Result<Vec<_>, _>>())
        .map_err(|e| bad("reading the certificate chain", &files.cert, &e))?;
    if certs.is_empty() {
        return Err(bad("reading the certificate chain", &files.cert, &"no CERTIFICATE in it"));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|e| bad("reading the private key", &files.key, &e))?;
    // ring builds with a C compiler alone (aws-lc-rs, which adds post-quantum key exchange, needs
    // more of the build machine)
    #[allow(deprecated)]
    let provider = Arc::new(tokio_rustls::rustls::crypto::ring::default_provider());
    let mut config = tokio_rustls::rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::Tls(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .map_err(|e| bad("the certificate and key", &files.cert, &e))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(config)))
}

/// Lets health checks through; every other gRPC call needs an API key when keys are set.
async fn grpc_auth(
    axum::extract::State(state): axum::extract::State<Arc<State>>,
    mut req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    if !req.uri().path().starts_with("/grpc.health.v1.Health/") {
        match state.authorize(req.headers().get("authorization").map(|v| v.as_bytes())) {
            Ok(Some(k)) => {
                req.extensions_mut().insert(k);
            }
            Ok(None) => {}
            Err(msg) => return tonic::Status::unauthenticated(msg).into_http(),
        }
    }
    next.run(req).await
}

/// Starts serving gRPC on `listener` (and metrics on `metrics`, if given) with health
/// NOT_SERVING and every inference call UNAVAILABLE until [`RunningServer::set_ready`].
pub async fn start(listener: TcpListener, metrics_listener: Option<TcpListener>) -> Result<RunningServer> {
    start_with(listener, metrics_listener, Options::default()).await
}

/// [`start`] with API keys, connection limits and TLS.
pub async fn start_with(
    listener: TcpListener,
    metrics_listener: Option<TcpListener>,
    options: Options,
) -> Result<RunningServer> {
    let addr = listener.local_addr().map_err(|e| Error::Io("reading the gRPC listener's address".into(), e))?;
    let tls = options.tls.as_ref().map(tls_acceptor).transpose()?;
    let state = Arc::new(State::new(&options));
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_service_status("", ServingStatus::NotServing).await;
    health.set_service_status(SERVICE_NAME, ServingStatus::NotServing).await;
    let reflect_v1 = reflection().build_v1()?;
    let reflect_v1alpha = reflection().build_v1alpha()?;
    let routes = tonic::service::Routes::new(health_svc)
        .add_service(reflect_v1)
        .add_service(reflect_v1alpha)
        .add_service(InferenceServiceServer::new(Service::new(state.clone())))
        .prepare()
        .into_axum_router()
        .layer(axum::middleware::from_fn_with_state(state.clone(), grpc_auth));
    let routes = one_port(routes, crate::http::router(state.clone()));
    let stats = ServerStats::default();
    let limits = options.limits.clone();
    let grpc = tokio::spawn(conn::serve(listener, routes, limits.clone(), tls.clone(), stats.grpc.clone()));
    let (metrics_addr, metrics) = match metrics_listener {
        Some(l) => {
            let a = l.local_addr().map_err(|e| Error::Io("reading the metrics listener's address".into(), e))?;
            let router = metrics::router(state.clone());
            let task = conn::serve(l, router, limits.clone(), tls.clone(), stats.metrics.clone());
            (Some(a), Some(tokio::spawn(task)))
        }
        None => (None, None),
    };
    state.set_conn_stats(stats.clone());
    let watch = std::sync::Mutex::new(None);
    Ok(RunningServer {
        addr,
        metrics_addr,
        state,
        health,
        grpc: Some(grpc),
        metrics,
        http: None,
        limits,
        tls,
        stats,
        watch,
    })
}

/// The gRPC port also answers the HTTP API, because llama-server's `--port` is its HTTP port: a
/// llama-server user's client pointed at `--port` works. Requests whose content type is gRPC's go
/// to the gRPC routes, every other one to the HTTP routes (their 404 for unknown paths included).
fn one_port(grpc: axum::Router, http: axum::Router) -> axum::Router {
    use tower::ServiceExt as _;
    let route = move |req: axum::extract::Request| {
        let is_grpc = req
            .headers()
            .get(axum::http::header::CONTENT_TYPE)
            .is_some_and(|v| v.as_bytes().starts_with(b"application/grpc"));
        let to = if is_grpc { grpc.clone() } else { http.clone() };
        to.oneshot(req)
    };
    axum::Router::new().fallback_service(tower::service_fn(route))
}

/// Connection counts of each port.
#[derive(Clone, Debug, Default)]
pub struct ServerStats {
    pub grpc: Arc<ConnStats>,
    pub http: Arc<ConnStats>,
    pub metrics: Arc<ConnStats>,
}

impl RunningServer {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_addr
    }

    /// Also serves the OpenAI- and llama-server-compatible HTTP API ([`crate::http`]) on
    /// `listener`, over the same engine, readiness and drain; returns its address.
    pub fn serve_http(&mut self, listener: TcpListener) -> Result<SocketAddr> {
        let addr = listener.local_addr().map_err(|e| Error::Io("reading the HTTP listener's address".into(), e))?;
        let router = crate::http::router(self.state.clone());
        let task = conn::serve(listener, router, self.limits.clone(), self.tls.clone(), self.stats.http.clone());
        self.http = Some(tokio::spawn(task));
        Ok(addr)
    }

    /// Connection counts of each port.
    pub fn stats(&self) -> &ServerStats {
        &self.stats
    }

    /// Starts answering with `engine`; health turns SERVING.
    pub async fn set_ready(&self, engine: EngineHandle, desc: &ModelDescription) {
        self.state.set_engine(engine.clone(), desc);
        self.health.set_service_status("", ServingStatus::Serving).await;
        self.health.set_service_status(SERVICE_NAME, ServingStatus::Serving).await;
        // health follows the engine: NOT_SERVING once it cannot run (a model file changed under
        // its mapping), checked here while idle and by the engine before every batch
        let health = self.health.clone();
        let watch = tokio::spawn(async move {
            loop {
                tokio::time::sleep(FILE_CHECK_INTERVAL).await;
                let files = engine.clone();
                let changed = tokio::task::spawn_blocking(move || files.check_files().is_err()).await.unwrap_or(true);
                if changed || !engine.is_running() {
                    health.set_service_status("", ServingStatus::NotServing).await;
                    health.set_service_status(SERVICE_NAME, ServingStatus::NotServing).await;
                    return;
                }
            }
        });
        if let Some(old) = self.watch.lock().unwrap_or_else(|e| e.into_inner()).replace(watch) {
            old.abort();
        }
    }

    /// Health NOT_SERVING, new calls UNAVAILABLE; waits up to `timeout` for open streams to end.
    pub async fn drain(&self, timeout: Duration) -> Drained {
        self.state.start_draining();
        self.health.set_service_status("", ServingStatus::NotServing).await;
        self.health.set_service_status(SERVICE_NAME, ServingStatus::NotServing).await;
        let mut streams = self.state.streams();
        let _ = tokio::time::timeout(timeout, streams.wait_for(|&n| n == 0)).await;
        let abandoned = *streams.borrow();
        Drained { abandoned }
    }

    /// Stops listening and closes every connection (after [`RunningServer::drain`], none has a
    /// request of ours in flight; a client watching health is simply cut off).
    pub async fn stop(mut self) -> Result<()> {
        // the last messages of the streams that just ended are still being written
        let deadline = tokio::time::Instant::now() + STOP_GRACE;
        let ports = [&self.stats.grpc, &self.stats.http, &self.stats.metrics];
        while ports.iter().any(|p| p.active.load(Ordering::Acquire) > 0) && tokio::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for task in [self.grpc.take(), self.metrics.take(), self.http.take()].into_iter().flatten() {
            task.abort();
            let _ = task.await;
        }
        Ok(())
    }
}

impl Drop for RunningServer {
    fn drop(&mut self) {
        if let Some(g) = &self.grpc {
            g.abort();
        }
        if let Some(m) = &self.metrics {
            m.abort();
        }
        if let Some(h) = &self.http {
            h.abort();
        }
        if let Some(w) = self.watch.lock().unwrap_or_else(|e| e.into_inner()).take() {
            w.abort();
        }
    }
}

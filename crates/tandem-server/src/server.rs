//! The running server: the inference service, `grpc.health.v1.Health` and server reflection on
//! one listener, and metrics on another. Its life: started NOT_SERVING while the model loads,
//! [`RunningServer::set_ready`] (SERVING), [`RunningServer::drain`] (NOT_SERVING, new calls
//! UNAVAILABLE, open streams finish), [`RunningServer::stop`].

use crate::pb::inference_service_server::InferenceServiceServer;
use crate::service::{ModelDescription, Service, State};
use crate::{metrics, pb, Error, Result};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tandem_engine::EngineHandle;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::TcpListenerStream;
use tonic::server::NamedService;
use tonic_health::server::HealthReporter;
use tonic_health::ServingStatus;

/// How long stopping waits for connections to close after the streams are done.
const STOP_GRACE: Duration = Duration::from_secs(2);

/// The service name health checks ask about, besides "" (the whole server).
pub const SERVICE_NAME: &str = <InferenceServiceServer<Service> as NamedService>::NAME;

pub struct RunningServer {
    addr: SocketAddr,
    metrics_addr: Option<SocketAddr>,
    state: Arc<State>,
    health: HealthReporter,
    stop_tx: Option<oneshot::Sender<()>>,
    grpc: Option<JoinHandle<std::result::Result<(), tonic::transport::Error>>>,
    metrics: Option<JoinHandle<()>>,
    http: Option<JoinHandle<()>>,
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

/// Starts serving gRPC on `listener` (and metrics on `metrics`, if given) with health
/// NOT_SERVING and every inference call UNAVAILABLE until [`RunningServer::set_ready`].
pub async fn start(listener: TcpListener, metrics_listener: Option<TcpListener>) -> Result<RunningServer> {
    let addr = listener.local_addr().map_err(|e| Error::Io("reading the gRPC listener's address".into(), e))?;
    let state = Arc::new(State::new());
    let (health, health_svc) = tonic_health::server::health_reporter();
    health.set_service_status("", ServingStatus::NotServing).await;
    health.set_service_status(SERVICE_NAME, ServingStatus::NotServing).await;
    let reflect_v1 = reflection().build_v1()?;
    let reflect_v1alpha = reflection().build_v1alpha()?;
    let (stop_tx, stop_rx) = oneshot::channel::<()>();
    let router = tonic::transport::Server::builder()
        .add_service(health_svc)
        .add_service(reflect_v1)
        .add_service(reflect_v1alpha)
        .add_service(InferenceServiceServer::new(Service::new(state.clone())));
    let grpc = tokio::spawn(router.serve_with_incoming_shutdown(TcpListenerStream::new(listener), async {
        let _ = stop_rx.await;
    }));
    let (metrics_addr, metrics) = match metrics_listener {
        Some(l) => {
            let a = l.local_addr().map_err(|e| Error::Io("reading the metrics listener's address".into(), e))?;
            (Some(a), Some(tokio::spawn(metrics::serve(l, state.clone()))))
        }
        None => (None, None),
    };
    Ok(RunningServer {
        addr,
        metrics_addr,
        state,
        health,
        stop_tx: Some(stop_tx),
        grpc: Some(grpc),
        metrics,
        http: None,
    })
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
        self.http = Some(tokio::spawn(crate::http::serve(listener, self.state.clone())));
        Ok(addr)
    }

    /// Starts answering with `engine`; health turns SERVING.
    pub async fn set_ready(&self, engine: EngineHandle, desc: &ModelDescription) {
        self.state.set_engine(engine, desc);
        self.health.set_service_status("", ServingStatus::Serving).await;
        self.health.set_service_status(SERVICE_NAME, ServingStatus::Serving).await;
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

    /// Stops listening and waits (briefly) for connections to close.
    pub async fn stop(mut self) -> Result<()> {
        if let Some(tx) = self.stop_tx.take() {
            let _ = tx.send(());
        }
        if let Some(m) = self.metrics.take() {
            m.abort();
        }
        if let Some(h) = self.http.take() {
            h.abort();
        }
        if let Some(mut g) = self.grpc.take() {
            // a client watching health keeps a stream open forever: do not wait for it
            match tokio::time::timeout(STOP_GRACE, &mut g).await {
                Ok(Ok(r)) => r?,
                Ok(Err(_)) => {}
                Err(_) => g.abort(),
            }
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
    }
}

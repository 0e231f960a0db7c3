//! gRPC front end over the engine: `tandem.v1.InferenceService` (proto/tandem/v1/inference.proto),
//! the standard `grpc.health.v1.Health`, server reflection (v1 and v1alpha) and Prometheus metrics.
//! Beside it, [`http`]: the OpenAI- and llama-server-compatible HTTP API over the same engine.
//! The server only translates: the engine owns the model and does the work.

mod anthropic;
mod codec;
mod conn;
mod convert;
pub mod http;
pub mod metrics;
mod openai;
pub mod reasoning;
mod server;
mod service;
mod slot_files;
mod stream;
pub mod tools;

pub use conn::{ConnStats, Limits};
pub use server::{
    start, start_with, Drained, Options, RunningServer, SamplingDefaults, ServerStats, TlsFiles, SERVICE_NAME,
};
pub use service::ModelDescription;

/// The generated messages, client and server of `tandem.v1`.
pub mod pb {
    #![allow(clippy::all)]
    tonic::include_proto!("tandem.v1");
    /// The encoded descriptor set of proto/tandem/v1 (served by reflection).
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("tandem_v1_descriptor");
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The error type of tandem-server.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{0}: {1}")]
    Io(String, #[source] std::io::Error),
    #[error("gRPC transport: {0}")]
    Transport(#[from] tonic::transport::Error),
    #[error("server reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error(transparent)]
    Engine(#[from] tandem_engine::Error),
    #[error("TLS: {0}")]
    Tls(String),
}

//! Accepting connections, for the gRPC, HTTP and metrics ports alike: TLS when configured, a cap
//! on open connections, and time limits, so that a flood of idle or slow connections cannot take
//! the server down.
//!
//! - A connection must send its first request within `header_timeout` (slowloris), and one with
//!   no request in flight is closed after `idle_timeout` (HTTP/1.1 keep-alive and HTTP/2 alike).
//! - At `max_connections`, a new connection closes the one that has been idle longest (no
//!   request in flight) to make room; when every connection is busy it is refused at once. A
//!   health check therefore gets in during a flood of idle connections, and a request that is
//!   being answered is never cut off for one.
//! - HTTP/2 keep-alive pings find dead peers; the TLS handshake shares the header time limit.

use axum::body::Body;
use axum::Router;
use http_body::Frame;
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::service::TowerToHyperService;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Notify;
use tokio::task::JoinSet;
use tower::ServiceExt;

/// Limits on the connections of one port.
#[derive(Clone, Debug, PartialEq)]
pub struct Limits {
    /// Open connections at most.
    pub max_connections: usize,
    /// Time a new connection has to complete TLS and send its first request's headers.
    pub header_timeout: Duration,
    /// Time a connection with no request in flight stays open.
    pub idle_timeout: Duration,
    /// HTTP/2 keep-alive ping interval (a peer that does not answer within it is dropped).
    pub keepalive: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: 1024,
            header_timeout: Duration::from_secs(10),
            idle_timeout: Duration::from_secs(120),
            keepalive: Duration::from_secs(30),
        }
    }
}

/// Counts kept per port (shown in metrics).
#[derive(Debug, Default)]
pub struct ConnStats {
    pub accepted: AtomicU64,
    /// Refused at the cap, every connection busy.
    pub refused: AtomicU64,
    /// Closed at the cap to make room.
    pub evicted: AtomicU64,
    /// Closed for sending no request within the time limits.
    pub timed_out: AtomicU64,
    pub open: AtomicUsize,
    /// Requests being answered, health watches aside (stopping waits for these).
    pub active: AtomicUsize,
}

/// One open connection.
struct Conn {
    /// Requests being answered (a streaming response counts until its body ends).
    inflight: AtomicUsize,
    /// Milliseconds since the registry's epoch when the connection last became idle; u64::MAX
    /// before its first request.
    idle_since: AtomicU64,
    opened: u64,
    close: Notify,
}

struct Registry {
    epoch: Instant,
    next: AtomicU64,
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    stats: Arc<ConnStats>,
}

impl Registry {
    fn now(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Arc<Conn>>> {
        self.conns.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Makes room for one more connection under `max`: false when every connection is busy.
    fn admit(&self, max: usize) -> bool {
        let mut conns = self.lock();
        if conns.len() < max {
            return true;
        }
        // idle longest: before its first request, since it opened; else since its last one ended
        let victim = conns
            .iter()
            .filter(|(_, c)| c.inflight.load(Ordering::Acquire) == 0)
            .min_by_key(|(_, c)| match c.idle_since.load(Ordering::Acquire) {
                u64::MAX => c.opened,
                t => t,
            })
            .map(|(&k, _)| k);
        match victim.and_then(|k| conns.remove(&k)) {
            Some(c) => {
                c.close.notify_one();
                self.stats.evicted.fetch_add(1, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    fn add(&self) -> (u64, Arc<Conn>) {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            inflight: AtomicUsize::new(0),
            idle_since: AtomicU64::new(u64::MAX),
            opened: self.now(),
            close: Notify::new(),
        });
        let mut conns = self.lock();
        conns.insert(id, conn.clone());
        self.stats.open.store(conns.len(), Ordering::Relaxed);
        (id, conn)
    }

    fn remove(&self, id: u64) {
        let mut conns = self.lock();
        conns.remove(&id);
        self.stats.open.store(conns.len(), Ordering::Relaxed);
    }
}

/// Marks a request in flight on its connection until dropped (with the response body).
struct InFlight {
    conn: Arc<Conn>,
    reg: Arc<Registry>,
    /// Counted in [`ConnStats::active`].
    active: bool,
}

impl InFlight {
    fn enter(conn: &Arc<Conn>, reg: &Arc<Registry>, path: &str) -> InFlight {
        conn.inflight.fetch_add(1, Ordering::AcqRel);
        // a health watch lasts as long as its client likes: it does not hold up stopping
        let active = path != "/grpc.health.v1.Health/Watch";
        if active {
            reg.stats.active.fetch_add(1, Ordering::AcqRel);
        }
        InFlight { conn: conn.clone(), reg: reg.clone(), active }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.conn.idle_since.store(self.reg.now(), Ordering::Release);
        self.conn.inflight.fetch_sub(1, Ordering::AcqRel);
        if self.active {
            self.reg.stats.active.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// A response body that keeps its request in flight until it ends or is dropped.
struct Tracked {
    inner: Body,
    _guard: InFlight,
}

impl http_body::Body for Tracked {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// A plain or TLS stream.
enum Io {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl AsyncRead for Io {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Io {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        match self.get_mut() {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }
}

/// Serves `router` on `listener` until the task is aborted (which closes every connection).
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    tls: Option<tokio_rustls::TlsAcceptor>,
    stats: Arc<ConnStats>,
) {
    let reg = Arc::new(Registry { epoch: Instant::now(), next: AtomicU64::new(0), conns: Mutex::default(), stats });
    let mut tasks = JoinSet::new();
    loop {
        // reap finished connections' tasks as we go
        while tasks.try_join_next().is_some() {}
        let tcp = match listener.accept().await {
            Ok((tcp, _)) => tcp,
            Err(_) => {
                // out of file descriptors (or a connection reset before accept): make room and
                // breathe rather than spin
                reg.admit(reg.lock().len());
                tokio::time::sleep(Duration::from_millis(5)).await;
                continue;
            }
        };
        if !reg.admit(limits.max_connections) {
            reg.stats.refused.fetch_add(1, Ordering::Relaxed);
            drop(tcp);
            continue;
        }
        reg.stats.accepted.fetch_add(1, Ordering::Relaxed);
        let (id, conn) = reg.add();
        let (reg, router, limits, tls) = (reg.clone(), router.clone(), limits.clone(), tls.clone());
        tasks.spawn(async move {
            connection(tcp, &conn, &reg, router, &limits, tls).await;
            reg.remove(id);
        });
    }
}

async fn connection(
    tcp: TcpStream,
    conn: &Arc<Conn>,
    reg: &Arc<Registry>,
    router: Router,
    limits: &Limits,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let _ = tcp.set_nodelay(true);
    let io = match tls {
        None => Io::Plain(tcp),
        Some(acceptor) => {
            let handshake = tokio::time::timeout(limits.header_timeout, acceptor.accept(tcp));
            tokio::select! {
                r = handshake => match r {
                    Ok(Ok(s)) => Io::Tls(Box::new(s)),
                    Ok(Err(_)) => return,
                    Err(_) => {
                        reg.stats.timed_out.fetch_add(1, Ordering::Relaxed);
                        return;
                    }
                },
                _ = conn.close.notified() => return,
            }
        }
    };
    let (c, r) = (conn.clone(), reg.clone());
    let svc = tower::service_fn(move |req: hyper::Request<Incoming>| {
        let guard = InFlight::enter(&c, &r, req.uri().path());
        let router = router.clone();
        async move {
            let resp = router.oneshot(req.map(Body::new)).await?;
            Ok::<_, std::convert::Infallible>(resp.map(|b| Body::new(Tracked { inner: b, _guard: guard })))
        }
    });
    // Every port speaks HTTP/1.1 and HTTP/2 (prior knowledge, or ALPN under TLS).
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_timeout);
    builder.http2().timer(TokioTimer::new()).keep_alive_interval(limits.keepalive).keep_alive_timeout(limits.keepalive);
    let served = builder.serve_connection(TokioIo::new(io), TowerToHyperService::new(svc));
    tokio::pin!(served);
    tokio::select! {
        _ = &mut served => {}
        _ = conn.close.notified() => {}
        _ = idle(conn, reg, limits) => {
            reg.stats.timed_out.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Resolves when the connection has had no request in flight for its time limit: the header
/// timeout before its first request, the idle timeout after.
async fn idle(conn: &Conn, reg: &Registry, limits: &Limits) {
    loop {
        let (since, limit) = match conn.idle_since.load(Ordering::Acquire) {
            u64::MAX => (conn.opened, limits.header_timeout),
            t => (t, limits.idle_timeout),
        };
        let limit = limit.as_millis() as u64;
        let busy = conn.inflight.load(Ordering::Acquire) > 0;
        let now = reg.now();
        let wait = if busy {
            limit
        } else if now >= since + limit {
            return;
        } else {
            since + limit - now
        };
        tokio::time::sleep(Duration::from_millis(wait.max(10))).await;
    }
}

//! Where the log goes: every crate logs through `tracing` and none prints; the binary installs
//! one subscriber on stderr. `--log-level` (or `RUST_LOG`, which wins: e.g.
//! `RUST_LOG=tandem_engine=debug`) chooses what is written, `--log-format text` writes lines as
//! `tandem: message` (`tandem serve: ...` for the server; warnings and errors say so; a request's
//! lines end with `[request id=...]`), `--log-format json` one JSON object per line with
//! timestamp, level, target, the event's fields and the request's span (its id) for log collectors.

use std::fmt;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::EnvFilter;

/// `--log-format`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Default)]
pub enum LogFormat {
    /// One line per event, `tandem: message`.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// The logging flags every command takes.
#[derive(clap::Args, Debug, Clone)]
pub struct LogArgs {
    /// What to log: error, warn, info, debug, trace or off (RUST_LOG, when set, takes precedence).
    #[arg(long = "log-level", value_name = "LEVEL", global = true, default_value = "info",
          value_parser = ["error", "warn", "info", "debug", "trace", "off"])]
    pub log_level: String,
    /// How log lines are written: text or json (one object per line).
    #[arg(long = "log-format", value_name = "FORMAT", global = true, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// Installs the subscriber for the process; text lines start with `prefix` (`tandem`).
pub fn init(args: &LogArgs, prefix: &'static str) -> anyhow::Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => EnvFilter::try_new(&v).map_err(|e| anyhow::anyhow!("RUST_LOG '{v}': {e}"))?,
        _ => EnvFilter::new(&args.log_level),
    };
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).with_ansi(false);
    let set = match args.log_format {
        LogFormat::Text => builder.event_format(Plain { prefix }).try_init(),
        LogFormat::Json => builder.json().flatten_event(true).with_current_span(true).with_span_list(false).try_init(),
    };
    set.map_err(|e| anyhow::anyhow!("installing the logger: {e}"))
}

/// `prefix: [warning: |error: ]message fields [request id=...]`.
struct Plain {
    prefix: &'static str,
}

impl<S, N> FormatEvent<S, N> for Plain
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut w: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        write!(w, "{}: ", self.prefix)?;
        match *event.metadata().level() {
            Level::ERROR => write!(w, "error: ")?,
            Level::WARN => write!(w, "warning: ")?,
            _ => {}
        }
        ctx.field_format().format_fields(w.by_ref(), event)?;
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                let ext = span.extensions();
                match ext.get::<FormattedFields<N>>() {
                    Some(f) if !f.is_empty() => write!(w, " [{} {f}]", span.name())?,
                    _ => write!(w, " [{}]", span.name())?,
                }
            }
        }
        writeln!(w)
    }
}

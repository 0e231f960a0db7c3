//! Engine events as server-sent events: one request's, or the merged events of several (OpenAI's
//! `n` and prompt lists, each choice under its own index). Dropping a stream (the client went
//! away) drops the reply channels' receivers, which tells the engine to free the slots.

use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use std::collections::VecDeque;
use std::convert::Infallible;
use std::pin::Pin;
use std::task::{Context, Poll};
use tandem_engine::{Event, Usage};
use tokio::sync::mpsc;
use tokio_stream::Stream;

struct EventStream<T, F> {
    rx: mpsc::UnboundedReceiver<T>,
    pending: VecDeque<SseEvent>,
    done: bool,
    /// Translates an event into server-sent events; true when it was the last.
    translate: F,
}

impl<T, F: FnMut(T) -> (Vec<SseEvent>, bool) + Send + Unpin> Stream for EventStream<T, F> {
    type Item = Result<SseEvent, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        loop {
            if let Some(event) = this.pending.pop_front() {
                return Poll::Ready(Some(Ok(event)));
            }
            if this.done {
                return Poll::Ready(None);
            }
            match this.rx.poll_recv(cx) {
                Poll::Ready(Some(ev)) => {
                    let (out, last) = (this.translate)(ev);
                    this.pending.extend(out);
                    this.done = last;
                }
                Poll::Ready(None) => this.done = true,
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}

/// A stream of server-sent events (Anthropic's have names).
pub(crate) fn sse_events<T, F>(rx: mpsc::UnboundedReceiver<T>, first: Vec<SseEvent>, translate: F) -> Response
where
    T: Send + 'static,
    F: FnMut(T) -> (Vec<SseEvent>, bool) + Send + Unpin + 'static,
{
    Sse::new(EventStream { rx, pending: first.into(), done: false, translate }).into_response()
}

fn data(v: Vec<String>) -> Vec<SseEvent> {
    v.into_iter().map(|d| SseEvent::default().data(d)).collect()
}

/// An OpenAI-style stream of one request: every event a `data:` payload.
pub(crate) fn sse<F>(rx: mpsc::UnboundedReceiver<Event>, first: Vec<String>, mut translate: F) -> Response
where
    F: FnMut(Event) -> (Vec<String>, bool) + Send + Unpin + 'static,
{
    sse_events(rx, data(first), move |ev| {
        let (out, last) = translate(ev);
        (data(out), last)
    })
}

/// What one choice's translator makes of an event.
pub(crate) enum Step {
    More(Vec<String>),
    /// The choice's last chunks and its usage.
    Done(Vec<String>, Usage),
    /// The stream ends here (an error chunk).
    Failed(Vec<String>),
}

/// One OpenAI-style stream of the choices `rxs`: each event goes through its choice's
/// translator; once every choice is done, `end` adds what follows the last chunks given the
/// usage of all (the usage chunk, `[DONE]`). A failure ends the stream.
pub(crate) fn merged<F, E>(
    rxs: Vec<mpsc::UnboundedReceiver<Event>>,
    first: Vec<String>,
    mut translators: Vec<F>,
    end: E,
) -> Response
where
    F: FnMut(Event) -> Step + Send + Unpin + 'static,
    E: FnOnce(Vec<String>, &[Usage]) -> Vec<String> + Send + Unpin + 'static,
{
    let mut usage: Vec<Option<Usage>> = vec![None; translators.len()];
    let mut end = Some(end);
    let mut step = move |j: usize, ev: Event| match translators[j](ev) {
        Step::More(out) => (data(out), false),
        Step::Failed(out) => (data(out), true),
        Step::Done(out, u) => {
            usage[j] = Some(u);
            if !usage.iter().all(Option::is_some) {
                return (data(out), false);
            }
            let all: Vec<Usage> = usage.iter().flatten().copied().collect();
            match end.take() {
                Some(end) => (data(end(out, &all)), true),
                None => (data(out), true),
            }
        }
    };
    let mut rxs = rxs;
    if rxs.len() == 1 {
        // one choice (the common case): its own channel, no task in between
        let rx = rxs.remove(0);
        return sse_events(rx, data(first), move |ev| step(0, ev));
    }
    let (tx, rx) = mpsc::unbounded_channel();
    for (j, mut choice) in rxs.into_iter().enumerate() {
        let tx = tx.clone();
        // ends (dropping the choice's receiver, which frees its slot) once the stream is gone
        tokio::spawn(async move {
            while let Some(ev) = choice.recv().await {
                if tx.send((j, ev)).is_err() {
                    break;
                }
            }
        });
    }
    sse_events(rx, data(first), move |(j, ev): (usize, Event)| step(j, ev))
}

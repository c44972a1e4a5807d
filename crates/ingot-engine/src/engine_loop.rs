//! The engine on its own thread: requests arrive through a channel, each request's output
//! deltas leave through its own channel, and a request whose receiver is dropped (a
//! disconnected client) is aborted before the next step, all its sequences at once.

use crate::engine::{Engine, EngineStats, QueueFull, RequestId, SeqDelta};
use crate::structured::{Grammar, Grammars};
use anyhow::Result;
use ingot_backend::Backend;
use ingot_core::SamplingParams;
use ingot_model::{Pooling, Tokenizer};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Why a request was not taken.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    /// Invalid parameters or a request that can never fit: the client's to fix.
    #[error("{0:#}")]
    Rejected(anyhow::Error),
    /// The queue is full; the client may retry later.
    #[error("{0}")]
    AtCapacity(QueueFull),
    #[error("the server is shutting down")]
    ShuttingDown,
    #[error("the engine has stopped")]
    Stopped,
}

/// Why a request ended without finishing.
#[derive(Clone, Debug, thiserror::Error)]
pub enum Failure {
    #[error("engine step failed: {0}")]
    Step(String),
    #[error("the server is shutting down and this request had not started")]
    ShuttingDown,
}

/// What a request's channel carries. The channel is tokio's unbounded one: the engine
/// thread sends without blocking, async servers `recv().await`, threads `blocking_recv()`.
pub type Event = Result<SeqDelta, Failure>;
pub type Events = tokio::sync::mpsc::UnboundedReceiver<Event>;
type EventSender = tokio::sync::mpsc::UnboundedSender<Event>;
/// Where the engine answers whether it took a request.
type AdmittedSender = tokio::sync::oneshot::Sender<Result<(), SubmitError>>;

enum Command {
    Add {
        id: RequestId,
        prompt: Vec<u32>,
        params: Box<SamplingParams>,
        grammar: Option<Grammar>,
        events: EventSender,
        admitted: AdmittedSender,
    },
    Embed {
        id: RequestId,
        inputs: Vec<Vec<u32>>,
        dimensions: Option<usize>,
        events: EventSender,
        admitted: AdmittedSender,
    },
    Abort(RequestId),
    /// Shutting down: refuse new requests and abort those not started.
    Drain,
    /// Abort everything still in flight.
    AbortAll,
}

/// A cloneable handle to the engine thread; the thread stops (after finishing what is in
/// flight) when the last clone is dropped.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<Inner>,
}

struct Inner {
    commands: Option<Sender<Command>>,
    thread: Option<JoinHandle<()>>,
    next_id: AtomicU64,
    stats: Arc<Mutex<EngineStats>>,
    tokenizer: Arc<Tokenizer>,
    grammars: Grammars,
    max_model_len: usize,
    pooling: Option<Pooling>,
    hidden_size: usize,
    /// Why its tensor-parallel group failed, once it did (the thread may still be running).
    group_failure: Box<dyn Fn() -> Option<String> + Send + Sync>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        drop(self.commands.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Admission {
    id: RequestId,
    events: Events,
    ack: tokio::sync::oneshot::Receiver<Result<(), SubmitError>>,
}

struct Live {
    events: EventSender,
    /// Samples still generating.
    remaining: usize,
}

impl EngineHandle {
    pub fn spawn<B: Backend + 'static>(mut engine: Engine<B>) -> EngineHandle
    where
        Engine<B>: Send,
    {
        let (tx, rx) = mpsc::channel::<Command>();
        let stats = Arc::new(Mutex::new(engine.stats()));
        let tokenizer = engine.tokenizer().clone();
        let grammars = engine.grammars().clone();
        let max_model_len = engine.max_model_len();
        let pooling = engine.pooling().cloned();
        let hidden_size = engine.hidden_size();
        let shared = stats.clone();
        let group_failure = Box::new(engine.failure_watch());
        let thread = std::thread::Builder::new()
            .name("ingot-engine".into())
            .spawn(move || run(&mut engine, rx, &shared))
            .expect("spawn the engine thread");
        let inner = Inner {
            commands: Some(tx),
            thread: Some(thread),
            next_id: AtomicU64::new(0),
            stats,
            tokenizer,
            grammars,
            max_model_len,
            pooling,
            hidden_size,
            group_failure,
        };
        EngineHandle {
            inner: Arc::new(inner),
        }
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.inner.tokenizer
    }

    pub fn max_model_len(&self) -> usize {
        self.inner.max_model_len
    }

    /// The pooling of an engine that serves embeddings; `None` where it generates.
    pub fn pooling(&self) -> Option<&Pooling> {
        self.inner.pooling.as_ref()
    }

    /// The model's hidden size: an embedding's length before any `dimensions` cut.
    pub fn hidden_size(&self) -> usize {
        self.inner.hidden_size
    }

    /// Counters as of the last step.
    pub fn stats(&self) -> EngineStats {
        *self.inner.stats.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Why the engine thread stopped by itself (a tensor-parallel rank failed), once it
    /// did: requests are refused from then on, and a server should exit.
    pub fn stopped(&self) -> Option<String> {
        let thread = self.inner.thread.as_ref();
        thread
            .is_some_and(|t| t.is_finished())
            .then(|| self.group_failure())
            .flatten()
    }

    /// Why a rank of the engine's tensor-parallel group failed, as soon as it did: the
    /// engine thread then answers its requests with the error and stops, unless it is
    /// waiting on a device that the failed rank left busy.
    pub fn group_failure(&self) -> Option<String> {
        (self.inner.group_failure)()
    }

    fn send(&self, cmd: Command) -> Result<(), SubmitError> {
        let tx = self.inner.commands.as_ref().expect("present until drop");
        tx.send(cmd).map_err(|_| SubmitError::Stopped)
    }

    /// Queues a request with its compiled constraint; the returned receiver answers
    /// whether it was admitted.
    fn submit(
        &self,
        command: impl FnOnce(RequestId, EventSender, AdmittedSender) -> Command,
    ) -> Result<Admission, SubmitError> {
        let id = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        let (events, rx) = tokio::sync::mpsc::unbounded_channel();
        let (admitted, ack) = tokio::sync::oneshot::channel();
        self.send(command(id, events, admitted))?;
        Ok(Admission {
            id,
            events: rx,
            ack,
        })
    }

    /// Submits a request from a thread; admission errors (invalid parameters, a constraint
    /// that does not compile, too long) come back here.
    pub fn add_request(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<(RequestId, Events), SubmitError> {
        let grammar = self
            .inner
            .grammars
            .compile_for(params.structured.as_ref())
            .map_err(SubmitError::Rejected)?;
        let a = self.submit(Self::add(prompt, params, grammar))?;
        let reply = a.ack.blocking_recv();
        admitted_reply(a.id, a.events, reply)
    }

    /// As [`add_request`](Self::add_request), awaiting admission without blocking the
    /// async runtime while the engine finishes its current step. A structured-output
    /// constraint is compiled on a blocking thread, never on the engine's.
    pub async fn add_request_async(
        &self,
        prompt: Vec<u32>,
        params: SamplingParams,
    ) -> Result<(RequestId, Events), SubmitError> {
        let grammar = match params.structured.clone() {
            None => None,
            Some(spec) => {
                let grammars = self.inner.grammars.clone();
                let compiled = tokio::task::spawn_blocking(move || grammars.compile(&spec))
                    .await
                    .map_err(|e| {
                        SubmitError::Rejected(anyhow::anyhow!("constraint compilation failed: {e}"))
                    })?;
                Some(compiled.map_err(SubmitError::Rejected)?)
            }
        };
        let a = self.submit(Self::add(prompt, params, grammar))?;
        let reply = a.ack.await;
        admitted_reply(a.id, a.events, reply)
    }

    /// Submits an embedding request (one delta with its vector per input), awaiting
    /// admission without blocking the async runtime.
    pub async fn embed_async(
        &self,
        inputs: Vec<Vec<u32>>,
        dimensions: Option<usize>,
    ) -> Result<(RequestId, Events), SubmitError> {
        let a = self.submit(|id, events, admitted| Command::Embed {
            id,
            inputs,
            dimensions,
            events,
            admitted,
        })?;
        admitted_reply(a.id, a.events, a.ack.await)
    }

    /// The command that queues a generation request.
    fn add(
        prompt: Vec<u32>,
        params: SamplingParams,
        grammar: Option<Grammar>,
    ) -> impl FnOnce(RequestId, EventSender, AdmittedSender) -> Command {
        move |id, events, admitted| Command::Add {
            id,
            prompt,
            params: Box::new(params),
            grammar,
            events,
            admitted,
        }
    }

    pub fn abort(&self, id: RequestId) {
        // A stopped engine has nothing left to abort.
        let _ = self.send(Command::Abort(id));
    }

    /// The first step of a shutdown: new requests are refused, and sequences that have
    /// not started are aborted (their clients get [`Failure::ShuttingDown`]); running ones
    /// go on.
    pub fn drain(&self) {
        let _ = self.send(Command::Drain);
    }

    /// Aborts every request in flight (their clients get [`Failure::ShuttingDown`]).
    pub fn abort_all(&self) {
        let _ = self.send(Command::AbortAll);
    }
}

/// The engine's answer to an `Add`: the request's channel, or why it was not taken.
fn admitted_reply(
    id: RequestId,
    events: Events,
    reply: Result<Result<(), SubmitError>, tokio::sync::oneshot::error::RecvError>,
) -> Result<(RequestId, Events), SubmitError> {
    reply.map_err(|_| SubmitError::Stopped)??;
    Ok((id, events))
}

/// The engine thread's state besides the engine.
#[derive(Default)]
struct Loop {
    live: HashMap<RequestId, Live>,
    draining: bool,
    /// This thread's busy time outside [`Engine::step`].
    between_steps: Duration,
}

impl Loop {
    /// Ends requests with `failure`: `lost` samples of each are gone, and the request too
    /// when `gone` (then its channel closes after the failure).
    fn fail(&mut self, lost: Vec<(RequestId, usize, bool)>, failure: &Failure) {
        for (id, n, gone) in lost {
            let Some(req) = self.live.get_mut(&id) else {
                continue;
            };
            let _ = req.events.send(Err(failure.clone()));
            req.remaining = req.remaining.saturating_sub(n);
            if gone || req.remaining == 0 {
                self.live.remove(&id);
            }
        }
    }

    /// Aborts the requests whose receivers are gone: their clients disconnected.
    fn abort_abandoned<B: Backend>(&mut self, engine: &mut Engine<B>) {
        self.live.retain(|&id, req| {
            let open = !req.events.is_closed();
            if !open {
                engine.abort(id);
            }
            open
        });
    }
}

/// The answer to a request the engine was given: taken, it goes live with its `n` outputs.
fn admit(
    live: &mut HashMap<RequestId, Live>,
    id: RequestId,
    events: EventSender,
    n: usize,
    result: Result<()>,
) -> Result<(), SubmitError> {
    result.map_err(|e| match e.downcast::<QueueFull>() {
        Ok(full) => SubmitError::AtCapacity(full),
        Err(e) => SubmitError::Rejected(e),
    })?;
    live.insert(
        id,
        Live {
            events,
            remaining: n,
        },
    );
    Ok(())
}

fn handle<B: Backend>(engine: &mut Engine<B>, state: &mut Loop, cmd: Command) {
    let live = &mut state.live;
    match cmd {
        Command::Add {
            id,
            prompt,
            params,
            grammar,
            events,
            admitted,
        } => {
            if state.draining {
                let _ = admitted.send(Err(SubmitError::ShuttingDown));
                return;
            }
            let n = params.n;
            let result = engine.add_compiled_request(id, prompt, *params, grammar);
            let _ = admitted.send(admit(live, id, events, n, result));
        }
        Command::Embed {
            id,
            inputs,
            dimensions,
            events,
            admitted,
        } => {
            if state.draining {
                let _ = admitted.send(Err(SubmitError::ShuttingDown));
                return;
            }
            let n = inputs.len();
            let result = engine.add_embed_request(id, inputs, dimensions);
            let _ = admitted.send(admit(live, id, events, n, result));
        }
        Command::Abort(id) => {
            engine.abort(id);
            live.remove(&id);
        }
        Command::Drain => {
            state.draining = true;
            let lost = engine.abort_unstarted();
            state.fail(lost, &Failure::ShuttingDown);
        }
        Command::AbortAll => {
            state.draining = true;
            for (id, req) in state.live.drain() {
                let _ = req.events.send(Err(Failure::ShuttingDown));
                engine.abort(id);
            }
        }
    }
}

/// Serves commands until every handle is gone, or until the engine can run no more steps
/// (its tensor-parallel group failed).
fn run<B: Backend>(engine: &mut Engine<B>, rx: Receiver<Command>, stats: &Mutex<EngineStats>) {
    let mut state = Loop::default();
    loop {
        // Idle: sleep until a command arrives; busy: take what is queued and keep stepping.
        if !engine.has_work() {
            match rx.recv() {
                Ok(cmd) => handle(engine, &mut state, cmd),
                Err(_) => return,
            }
        }
        let mut mark = Instant::now();
        while let Ok(cmd) = rx.try_recv() {
            handle(engine, &mut state, cmd);
        }
        state.abort_abandoned(engine);
        let live = &mut state.live;
        if engine.has_work() {
            state.between_steps += mark.elapsed();
            let result = engine.step();
            mark = Instant::now();
            match result {
                Ok(deltas) => {
                    for d in deltas {
                        let id = d.request_id;
                        let Some(req) = live.get_mut(&id) else {
                            continue;
                        };
                        let finished = d.finish_reason.is_some();
                        if req.events.send(Ok(d)).is_err() {
                            // The receiver is gone: nobody wants the rest.
                            engine.abort(id);
                            live.remove(&id);
                            continue;
                        }
                        if finished {
                            req.remaining -= 1;
                            if req.remaining == 0 {
                                live.remove(&id);
                            }
                        }
                    }
                }
                Err(e) => {
                    tracing::error!("engine step failed: {e:#}");
                    for (id, req) in live.drain() {
                        let _ = req.events.send(Err(Failure::Step(format!("{e:#}"))));
                        engine.abort(id);
                    }
                    if let Some(why) = engine.stopped() {
                        tracing::error!("the engine stops: {why}");
                        return;
                    }
                }
            }
        }
        let mut now = engine.stats();
        state.between_steps += mark.elapsed();
        now.phases.between_steps = state.between_steps;
        *stats.lock().unwrap_or_else(|e| e.into_inner()) = now;
    }
}

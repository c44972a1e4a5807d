//! `ingot serve`: the OpenAI-compatible server. It listens at once (`/health` answers 503
//! while the model loads), and on SIGTERM or Ctrl-C stops accepting, aborts the requests
//! that have not started, lets running ones finish within a grace period, and exits 0.

use crate::device::{ModelArgs, OnBackend, TaskArgs};
use crate::generate::EngineArgs;
use anyhow::{Context, Result};
use ingot_backend::Backend;
use ingot_engine::{Engine, EngineConfig, EngineHandle};
use ingot_server::{AppState, ServerConfig};
use std::future::IntoFuture;
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    task: TaskArgs,
    #[arg(long, default_value = "0.0.0.0")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// The model name clients use (default: the model file or directory name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Require `Authorization: Bearer KEY` on every /v1 route.
    #[arg(long)]
    api_key: Option<String>,
    /// Refuse a request with 503 when the sequences waiting (each prompt and each of its
    /// `n` samples is one) would exceed this.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    /// Most samples (`n`) one request may ask for.
    #[arg(long, default_value_t = 128)]
    max_n: usize,
    /// Most prompts in one completions request, and inputs in one embeddings request.
    #[arg(long, default_value_t = 256)]
    max_prompts_per_request: usize,
    /// Let the model decide to call tools (`tool_choice` `auto`, the default when a
    /// request has tools); its calls are parsed with --tool-call-parser.
    #[arg(long, requires = "tool_call_parser")]
    enable_auto_tool_choice: bool,
    /// How the model writes tool calls: hermes, qwen3, llama3_json or mistral.
    #[arg(long)]
    tool_call_parser: Option<ingot_server::tools::ToolParser>,
    /// Tell a reasoning model's thinking from its answer: qwen3 or deepseek_r1. The
    /// thinking goes to `reasoning_content`, and structured output starts after it.
    #[arg(long)]
    reasoning_parser: Option<ingot_server::reasoning::ReasoningParser>,
    /// Seconds in-flight requests get to finish after a shutdown signal.
    #[arg(long, default_value_t = 30)]
    shutdown_grace: u64,
    #[command(flatten)]
    engine: EngineArgs,
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! { _ = ctrl_c => {}, _ = term => {} }
    tracing::info!("shutting down: no new connections, finishing requests in flight");
}

/// Loads the model on the chosen backend and starts the engine thread.
struct StartEngine {
    model: ModelArgs,
    task: TaskArgs,
    config: EngineConfig,
}

impl OnBackend for StartEngine {
    type Output = EngineHandle;
    fn run<B: Backend + 'static>(self, devices: Vec<B>) -> Result<EngineHandle> {
        let pooling = self.model.pooling(&self.task)?;
        let (ranks, tokenizer) = self.model.load(devices)?;
        let config = EngineConfig {
            pooling,
            ..self.config
        };
        let engine = Engine::with_ranks(ranks, Arc::new(tokenizer), config)?;
        Ok(EngineHandle::spawn(engine))
    }
}

pub fn run(args: Args) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(serve(args))
}

async fn serve(args: Args) -> Result<()> {
    let name = args.served_model_name.clone().unwrap_or_else(|| {
        let path = &args.model.model;
        let stem = path
            .file_stem()
            .or(path.file_name())
            .map(|s| s.to_string_lossy().into_owned());
        stem.unwrap_or_else(|| "model".into())
    });
    let tool_parser = args
        .tool_call_parser
        .filter(|_| args.enable_auto_tool_choice);
    let state = AppState::new(ServerConfig {
        served_model_name: name.clone(),
        api_key: args.api_key.clone(),
        max_n: args.max_n,
        max_prompts_per_request: args.max_prompts_per_request,
        max_body_bytes: 8 << 20,
        tool_parser,
        reasoning_parser: args.reasoning_parser,
    });
    let addr = format!("{}:{}", args.host, args.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .with_context(|| format!("cannot listen on {addr}"))?;
    tracing::info!(
        "listening on http://{}, serving `{name}` once loaded",
        listener.local_addr()?
    );

    let loading = state.clone();
    let job = StartEngine {
        model: args.model.clone(),
        task: args.task.clone(),
        config: EngineConfig {
            max_waiting: Some(args.max_waiting),
            ..args.engine.config()
        },
    };
    let loader = tokio::task::spawn_blocking(move || -> Result<()> {
        let handle = job.model.clone().on_backend(job)?;
        let _ = loading.engine.set(handle);
        tracing::info!("model loaded; ready");
        Ok(())
    });
    let (signalled, mut signal) = tokio::sync::watch::channel(false);
    let app = ingot_server::router(state.clone());
    let draining = state.clone();
    let graceful = async move {
        shutdown_signal().await;
        if let Some(engine) = draining.engine.get() {
            engine.drain();
        }
        let _ = signalled.send(true);
    };
    let mut server = tokio::spawn(
        axum::serve(listener, app)
            .with_graceful_shutdown(graceful)
            .into_future(),
    );
    loader.await.context("the loader panicked")??;
    let grace = Duration::from_secs(args.shutdown_grace);
    let engine = state.engine.get().cloned();
    let engine_stopped = async move {
        let engine = engine.as_ref()?;
        loop {
            if let Some(why) = engine.stopped() {
                return Some(why);
            }
            if let Some(why) = engine.group_failure() {
                // The engine thread answers its requests with the error and ends, unless
                // a device the failed rank left busy holds it.
                for _ in 0..50 {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    if engine.stopped().is_some() {
                        break;
                    }
                }
                return Some(engine.stopped().unwrap_or(why));
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    };
    tokio::select! {
        r = &mut server => r.context("the server task panicked")?.context("server error")?,
        Some(why) = engine_stopped => {
            // The requests answered with the error get a moment to reach their clients;
            // then the process exits here, as unwinding would join an engine thread that
            // may be waiting on a device for good.
            tokio::time::sleep(Duration::from_secs(1)).await;
            eprintln!("error: the engine stopped: {why}");
            crate::exit_failed();
        }
        _ = async {
            let _ = signal.wait_for(|s| *s).await;
            tokio::time::sleep(grace).await;
        } => {
            tracing::warn!("grace period of {grace:?} over; aborting the requests still in flight");
            if let Some(engine) = state.engine.get() {
                engine.abort_all();
            }
        }
    }
    Ok(())
}

//! `ingot serve`: the OpenAI-compatible server. It listens at once (`/health` answers 503
//! while the model loads), and on SIGTERM or Ctrl-C stops accepting, lets in-flight
//! requests finish within a grace period, and exits 0.

use crate::generate::EngineArgs;
use anyhow::{Context, Result};
use ingot_backend::cpu::CpuBackend;
use ingot_engine::{Engine, EngineHandle};
use ingot_model::WeightDType;
use ingot_server::{AppState, ServerConfig};
use std::future::IntoFuture;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    /// An HF model directory or a .gguf file.
    #[arg(long)]
    model: PathBuf,
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
    /// Refuse new requests with 503 while this many wait.
    #[arg(long, default_value_t = 256)]
    max_waiting: usize,
    #[arg(long, default_value = "auto")]
    dtype: WeightDType,
    #[arg(long)]
    threads: Option<usize>,
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

pub fn run(args: Args) -> Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(serve(args))
}

async fn serve(args: Args) -> Result<()> {
    let name = args.served_model_name.clone().unwrap_or_else(|| {
        let stem = args
            .model
            .file_stem()
            .or(args.model.file_name())
            .map(|s| s.to_string_lossy().into_owned());
        stem.unwrap_or_else(|| "model".into())
    });
    let state = AppState::new(ServerConfig {
        served_model_name: name.clone(),
        api_key: args.api_key.clone(),
        max_waiting: args.max_waiting,
        max_body_bytes: 8 << 20,
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
    let (model, dtype, threads, config) = (
        args.model.clone(),
        args.dtype,
        args.threads,
        args.engine.config(),
    );
    let loader = tokio::task::spawn_blocking(move || -> Result<()> {
        let backend = CpuBackend::new(threads)?;
        let (model, tokenizer) = ingot_model::load(&backend, &model, dtype)?;
        let engine = Engine::new(backend, model, Arc::new(tokenizer), config)?;
        let _ = loading.engine.set(EngineHandle::spawn(engine));
        tracing::info!("model loaded; ready");
        Ok(())
    });
    let (signalled, mut signal) = tokio::sync::watch::channel(false);
    let app = ingot_server::router(state);
    let graceful = async move {
        shutdown_signal().await;
        let _ = signalled.send(true);
    };
    let mut server = tokio::spawn(
        axum::serve(listener, app)
            .with_graceful_shutdown(graceful)
            .into_future(),
    );
    loader.await.context("the loader panicked")??;
    let grace = Duration::from_secs(args.shutdown_grace);
    tokio::select! {
        r = &mut server => r.context("the server task panicked")?.context("server error")?,
        _ = async {
            let _ = signal.wait_for(|s| *s).await;
            tokio::time::sleep(grace).await;
        } => tracing::warn!("grace period of {grace:?} over; exiting with requests still in flight"),
    }
    Ok(())
}

//! The `ingot` command line.

mod bench;
mod device;
mod generate;
mod serve;
mod validate;

use clap::{Parser, Subcommand};

// A long-running server allocates from many threads; glibc's per-thread arenas let its
// resident memory creep up under mixed traffic (bench/soak.py measured +6.69 % in ten
// minutes after warm-up), where mimalloc returns freed pages. mimalloc's v2 line: its v3
// line (the crate's default) committed ever more memory that nothing held, +1.77 % in
// twelve minutes of the soak where v2 stayed at +0.06 % (docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// mimalloc's `mi_option_purge_delay` (its index in both the v2 and v3 headers; the Rust
/// bindings name no constant for it).
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

#[derive(Parser)]
#[command(name = "ingot", version, about = "An LLM serving engine")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate completions for one prompt or a batch.
    Generate(generate::Args),
    /// Serve the OpenAI-compatible API.
    Serve(serve::Args),
    /// Measure the engine.
    #[command(subcommand)]
    Bench(bench::Command),
    /// Run the validation suite against a model and write a report.
    Validate(validate::Args),
}

fn main() {
    // Freed memory goes back to the system at once, not 10–100 ms later and only when the
    // next allocation looks: otherwise an idle server keeps what its last requests freed
    // (one 50,000-token prompt left 70 MiB resident) and its RSS swings by tens of MiB
    // with the traffic mix, which hides a real leak and fails a stability test. A delay
    // set in the environment is kept.
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: sets a global option of the allocator; no other thread runs yet.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
    }
    // NCCL's multicast over NVLink (NVLS) reserves fabric memory on the host's switches;
    // tensor-parallel groups here do without it unless the environment asks for it.
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        std::env::set_var("NCCL_NVLS_ENABLE", "0");
    }
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let result = match Cli::parse().command {
        Command::Generate(args) => generate::run(args),
        Command::Serve(args) => serve::run(args),
        Command::Bench(cmd) => bench::run(cmd),
        Command::Validate(args) => validate::run(args),
    };
    if let Err(e) = result {
        eprintln!("error: {e:#}");
        exit_failed();
    }
}

/// Exits with status 1, without the libraries' exit handlers once a tensor-parallel group
/// was aborted (see [`ingot_backend::collective::any_aborted`]).
fn exit_failed() -> ! {
    if ingot_backend::collective::any_aborted() {
        use std::io::Write;
        let _ = std::io::stdout().flush();
        // SAFETY: ends the process at once; nothing runs after it.
        unsafe { libc::_exit(1) };
    }
    std::process::exit(1)
}

//! Writes a tiny random model (`SyntheticSpec::tiny`) as an HF directory, for the reference
//! scripts in tools/reference: `cargo run -p ingot-model --example synthetic -- qwen3 DIR`.

use anyhow::{Context, Result};
use ingot_model::synthetic::SyntheticSpec;
use ingot_model::Arch;

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: synthetic ARCH DIR (ARCH: llama, mistral, qwen2, qwen3)";
    let arch = Arch::from_name(&args.next().context(usage)?)?;
    let dir = args.next().context(usage)?;
    SyntheticSpec::tiny(arch).write(dir.as_ref())
}

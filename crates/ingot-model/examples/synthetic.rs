//! Writes a tiny random model (`SyntheticSpec::tiny`) as an HF directory, for the reference
//! scripts in tools/reference and for benchmarks of shapes no checkpoint here has:
//! `cargo run -p ingot-model --example synthetic -- qwen3 DIR [KEY=VALUE ...]`, where KEY
//! is vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, max_positions, or (for
//! qwen3_moe and mixtral) experts, per_token and expert_width.

use anyhow::{bail, Context, Result};
use ingot_model::synthetic::SyntheticSpec;
use ingot_model::Arch;

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let usage = "usage: synthetic ARCH DIR [KEY=VALUE ...] (ARCH: llama, mistral, qwen2, qwen3, qwen3_moe, mixtral)";
    let arch = Arch::from_name(&args.next().context(usage)?)?;
    let dir = args.next().context(usage)?;
    let mut spec = SyntheticSpec::tiny(arch);
    for kv in args {
        let (key, value) = kv.split_once('=').context(usage)?;
        let n: usize = value
            .parse()
            .with_context(|| format!("{key}: `{value}` is not a count"))?;
        let experts = || {
            spec.experts
                .with_context(|| format!("{key}: {arch:?} has no experts"))
        };
        match key {
            "vocab" => spec.vocab_size = n,
            "hidden" => spec.hidden_size = n,
            "intermediate" => spec.intermediate_size = n,
            "layers" => spec.num_layers = n,
            "heads" => spec.num_heads = n,
            "kv_heads" => spec.num_kv_heads = n,
            "head_dim" => spec.head_dim = n,
            "max_positions" => spec.max_positions = n,
            "experts" => spec.experts = Some((n, experts()?.1, experts()?.2)),
            "per_token" => spec.experts = Some((experts()?.0, n, experts()?.2)),
            "expert_width" => spec.experts = Some((experts()?.0, experts()?.1, n)),
            other => bail!("unknown key `{other}`; {usage}"),
        }
    }
    spec.write(dir.as_ref())
}

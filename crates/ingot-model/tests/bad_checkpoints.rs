//! Broken or unsupported model files are errors that say what is wrong.

use ingot_backend::cpu::CpuBackend;
use ingot_model::synthetic::SyntheticSpec;
use ingot_model::{Arch, WeightDType};
use std::path::{Path, PathBuf};

fn temp(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("ingot-bad-{}-{name}", std::process::id()))
}

fn load_err(path: &Path) -> String {
    let b = CpuBackend::new(Some(1)).unwrap();
    match ingot_model::load(&b, path, WeightDType::Auto) {
        Ok(_) => panic!("{} loaded", path.display()),
        Err(e) => format!("{e:#}"),
    }
}

/// A GGUF v3 header with one string key and one tensor descriptor; `data` follows, aligned.
fn gguf(arch: &str, tensor_type: u32, dims: &[u64], data: &[u8]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    b.extend(1u64.to_le_bytes());
    let s = |b: &mut Vec<u8>, s: &str| {
        b.extend((s.len() as u64).to_le_bytes());
        b.extend(s.as_bytes());
    };
    s(&mut b, "general.architecture");
    b.extend(8u32.to_le_bytes());
    s(&mut b, arch);
    s(&mut b, "token_embd.weight");
    b.extend((dims.len() as u32).to_le_bytes());
    dims.iter().for_each(|d| b.extend(d.to_le_bytes()));
    b.extend(tensor_type.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.resize(b.len().div_ceil(32) * 32, 0);
    b.extend(data);
    b
}

#[test]
fn gguf_errors_name_the_problem() {
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("magic.gguf", b"GGML-not-really".to_vec(), "bad magic"),
        ("short.gguf", b"GGUF\x03\x00".to_vec(), "truncated"),
        (
            "past-end.gguf",
            gguf("llama", 0, &[32, 4], &[0; 16]),
            "past the end",
        ),
        ("q2k.gguf", gguf("llama", 10, &[256, 1], &[]), "Q2_K"),
        (
            "arch.gguf",
            gguf("gpt2", 0, &[4, 2], &[0; 32]),
            "unsupported model architecture `gpt2`",
        ),
    ];
    for (name, bytes, want) in cases {
        let p = temp(name);
        std::fs::write(&p, bytes).unwrap();
        let e = load_err(&p);
        assert!(e.contains(want), "{name}: `{e}` should mention `{want}`");
        std::fs::remove_file(&p).ok();
    }
}

#[test]
fn hf_directory_errors_name_the_problem() {
    let dir = temp("hf");
    SyntheticSpec::tiny(Arch::Llama).write(&dir).unwrap();
    // A config promising more layers than the weights hold.
    let cfg = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(
        dir.join("config.json"),
        cfg.replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 3"),
    )
    .unwrap();
    let e = load_err(&dir);
    assert!(e.contains("missing weight") && e.contains("layer 2"), "{e}");
    std::fs::write(dir.join("config.json"), "{ not json").unwrap();
    assert!(load_err(&dir).contains("config.json is not valid JSON"));
    std::fs::remove_file(dir.join("model.safetensors")).unwrap();
    assert!(load_err(&dir).contains("no model.safetensors"));
    std::fs::remove_dir_all(&dir).ok();
    assert!(load_err(&temp("absent")).contains("no such file or directory"));
}

//! The `ingot` binary end to end: output formats, the chat flag and error exits.

use ingot_model::synthetic::SyntheticSpec;
use ingot_model::Arch;
use std::process::Command;

fn ingot(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_ingot"))
        .args(args)
        .output()
        .unwrap()
}

/// Runs `ingot` to success and parses its standard output as one JSON value.
fn ingot_json(args: &[&str]) -> serde_json::Value {
    let out = ingot(args);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn generate_prints_json_with_prompt_and_generated_ids() {
    let dir = std::env::temp_dir().join(format!("ingot-cli-{}", std::process::id()));
    SyntheticSpec::tiny(Arch::Qwen2).write(&dir).unwrap();
    let model = dir.to_str().unwrap();
    let v = ingot_json(&[
        "generate",
        "--model",
        model,
        "--prompt",
        "w3 w5 w7",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--format",
        "json",
        "--threads",
        "1",
    ]);
    assert_eq!(v["prompt_token_ids"], serde_json::json!([3, 5, 7]));
    assert_eq!(v["token_ids"].as_array().unwrap().len(), 6);
    assert!(
        v["text"].is_string()
            && v["prefill_tok_s"].as_f64().unwrap() > 0.0
            && v["decode_tok_s"].as_f64().unwrap() > 0.0
    );

    // Greedy decoding is deterministic; a seeded sample is reproducible.
    let again = ingot(&[
        "generate",
        "--model",
        model,
        "--prompt",
        "w3 w5 w7",
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--format",
        "json",
    ]);
    let w: serde_json::Value = serde_json::from_slice(&again.stdout).unwrap();
    assert_eq!(v["token_ids"], w["token_ids"]);
    let sample = |seed: &str| {
        let o = ingot(&[
            "generate",
            "--model",
            model,
            "--prompt",
            "w3",
            "--max-tokens",
            "8",
            "--ignore-eos",
            "--temperature",
            "1.0",
            "--seed",
            seed,
            "--format",
            "json",
        ]);
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["token_ids"].clone()
    };
    assert_eq!(sample("5"), sample("5"));

    // --chat goes through the template in tokenizer_config.json.
    let chat = ingot(&[
        "generate",
        "--model",
        model,
        "--prompt",
        "w9",
        "--chat",
        "--max-tokens",
        "1",
        "--format",
        "json",
    ]);
    assert!(
        chat.status.success(),
        "{}",
        String::from_utf8_lossy(&chat.stderr)
    );

    let long = "w4 ".repeat(600);
    let too_long = ingot(&[
        "generate",
        "--model",
        model,
        "--prompt",
        &long,
        "--max-tokens",
        "4",
    ]);
    assert_eq!(too_long.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&too_long.stderr).contains("maximum context length is 512 tokens")
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_arguments_are_reported() {
    let no_prompt = ingot(&["generate", "--model", "x.gguf"]);
    assert_eq!(no_prompt.status.code(), Some(2));
    let missing = ingot(&[
        "generate",
        "--model",
        "/nonexistent/model.gguf",
        "--prompt",
        "hi",
    ]);
    assert_eq!(missing.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&missing.stderr).contains("no such file or directory"));
    let dtype = ingot(&[
        "generate", "--model", "m", "--prompt", "hi", "--dtype", "int3",
    ]);
    assert_eq!(dtype.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&dtype.stderr).contains("int3"));
}

/// `bench masks` starts its rows' parsers, then steps them through the schema's answer: a
/// mask a row a step, timed; a text the schema refuses is an error naming the token.
#[test]
fn bench_masks_walks_the_answer_and_refuses_a_text_the_schema_does_not_allow() {
    let Some(model) = ingot_model::testing::test_model_path() else {
        return;
    };
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../bench/schemas");
    let (schema, answer) = (
        format!("{root}/records.json"),
        format!("{root}/records-answer.txt"),
    );
    let model = model.to_str().unwrap();
    let args = [
        "bench",
        "masks",
        "--tokenizer",
        model,
        "--json-schema",
        &schema,
        "--rows",
        "3",
        "--threads",
        "2",
        "--format",
        "json",
    ];
    let v = ingot_json(&[&args[..], &["--text", &answer, "--steps", "20"]].concat());
    assert_eq!(v["masks"], 60);
    assert!(v["mask_us"].as_f64().unwrap() > 0.0);
    assert!(v["step_wall_us"]["median"].as_f64().unwrap() > 0.0);
    assert!(v["start_wall_us"].as_f64().unwrap() > 0.0);
    let bad = std::env::temp_dir().join(format!("ingot-bad-answer-{}.txt", std::process::id()));
    std::fs::write(&bad, "{\"records\": 7}").unwrap();
    let out = ingot(&[&args[..], &["--text", bad.to_str().unwrap()]].concat());
    std::fs::remove_file(&bad).ok();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("of the text"), "{stderr}");
}

/// `bench latency` and `bench throughput` on dummy weights from a directory holding only
/// config.json: every figure is reported, and the numbers are measured (positive, ordered
/// and adding up as they must).
#[test]
fn benches_run_on_dummy_weights_from_a_config() {
    let dir = std::env::temp_dir().join(format!("ingot-cli-dummy-{}", std::process::id()));
    SyntheticSpec::tiny(Arch::Llama).write(&dir).unwrap();
    for f in [
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        std::fs::remove_file(dir.join(f)).unwrap();
    }
    let model = dir.to_str().unwrap();
    let run = || {
        ingot(&[
            "bench",
            "latency",
            "--model",
            model,
            "--load-format",
            "dummy",
            "--device",
            "cpu",
            "--threads",
            "1",
            "--batch-size",
            "3",
            "--input-len",
            "20",
            "--output-len",
            "5",
            "--warmup",
            "0",
            "--iters",
            "2",
            "--format",
            "json",
        ])
    };
    let out = run();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (v["batch_size"].as_u64(), v["iters"].as_u64()),
        (Some(3), Some(2))
    );
    for key in [
        "ttft_ms",
        "tpot_ms",
        "e2e_ms",
        "prefill_tok_s",
        "decode_tok_s",
    ] {
        let s = &v[key];
        let (min, med, max) = (
            s["min"].as_f64().unwrap(),
            s["median"].as_f64().unwrap(),
            s["max"].as_f64().unwrap(),
        );
        assert!(0.0 < min && min <= med && med <= max, "{key}: {s}");
    }
    assert!(v["e2e_ms"]["min"].as_f64() > v["ttft_ms"]["min"].as_f64());
    // Without the auto format the directory is not a checkpoint.
    let plain = ingot(&[
        "generate", "--model", model, "--prompt", "w3", "--device", "cpu",
    ]);
    assert!(!plain.status.success());
    assert!(String::from_utf8_lossy(&plain.stderr).contains("model.safetensors"));
    // A GPU profile needs op-by-op steps.
    let out = ingot(&[
        "bench",
        "latency",
        "--model",
        model,
        "--load-format",
        "dummy",
        "--device",
        "cpu",
        "--profile-ops",
    ]);
    assert!(String::from_utf8_lossy(&out.stderr).contains("--enforce-eager"));

    // Throughput: every request runs to its drawn length, so the token counts add up.
    let v = ingot_json(&[
        "bench",
        "throughput",
        "--model",
        model,
        "--load-format",
        "dummy",
        "--device",
        "cpu",
        "--threads",
        "1",
        "--num-prompts",
        "9",
        "--input-len",
        "12",
        "--output-len",
        "6",
        "--range-ratio",
        "0.5",
        "--warmup",
        "1",
        "--format",
        "json",
    ]);
    let (prompt, output) = (
        v["prompt_tokens"].as_u64().unwrap(),
        v["output_tokens"].as_u64().unwrap(),
    );
    assert!((9 * 6..=9 * 18).contains(&prompt), "{v}");
    assert!((9 * 3..=9 * 9).contains(&output), "{v}");
    let elapsed = v["elapsed_s"].as_f64().unwrap();
    let total = v["total_tok_s"].as_f64().unwrap();
    assert!((total * elapsed - (prompt + output) as f64).abs() < 1e-6 * total * elapsed);
    assert!(v["e2e_ms"]["max"].as_f64() >= v["ttft_ms"]["max"].as_f64());
    let bad = ingot(&[
        "bench",
        "throughput",
        "--model",
        model,
        "--load-format",
        "dummy",
        "--device",
        "cpu",
        "--range-ratio",
        "1.5",
    ]);
    assert!(String::from_utf8_lossy(&bad.stderr).contains("--range-ratio"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn validate_writes_a_report_with_every_test() {
    let dir = std::env::temp_dir().join(format!("ingot-validate-{}", std::process::id()));
    SyntheticSpec::tiny(Arch::Llama).write(&dir).unwrap();
    let out = dir.join("report");
    let run = ingot(&[
        "validate",
        "--model",
        dir.to_str().unwrap(),
        "--quick",
        "--max-model-len",
        "256",
        "--minutes",
        "0.05",
        "--clients",
        "4",
        "--threads",
        "1",
        "--out",
        out.to_str().unwrap(),
        "--format",
        "json",
    ]);
    let v: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    let sections = v["sections"].as_array().unwrap();
    let numbers: Vec<u64> = sections
        .iter()
        .map(|s| s["number"].as_u64().unwrap())
        .collect();
    assert_eq!(numbers, (1..=8).collect::<Vec<_>>());
    let status = |n: usize| sections[n - 1]["status"].as_str().unwrap().to_string();
    // No transformers fixtures exist for a synthetic model.
    assert_eq!(status(4), "SKIP", "{}", sections[3]);
    // Exact on the CPU: batched equals alone, repeated runs equal, limits exact, no errors.
    for n in [5, 6, 7, 8] {
        assert_eq!(status(n), "PASS", "{}", sections[n - 1]);
    }
    for n in [1, 2, 3] {
        assert_ne!(status(n), "FAIL", "{}", sections[n - 1]);
        assert!(!sections[n - 1]["table"]["rows"]
            .as_array()
            .unwrap()
            .is_empty());
    }
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("## 7. token cap — PASS"), "{md}");
    let on_disk: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).unwrap()).unwrap();
    assert_eq!(on_disk["sections"], v["sections"]);
    for chart in v["charts"].as_array().unwrap() {
        let svg = std::fs::read_to_string(out.join(chart.as_str().unwrap())).unwrap();
        assert!(svg.starts_with("<svg"), "{chart}");
    }
    assert_eq!(v["charts"].as_array().unwrap().len(), 3);
    let _ = std::fs::remove_dir_all(&dir);
}

//! Finding the real test model for tests and benchmarks.

use std::path::PathBuf;

/// The GGUF test model fetched by `scripts/fetch-test-model`: `$INGOT_TEST_MODEL`, else the
/// script's cache location. Returns `None` when it is absent and CI is not running; under
/// CI (`CI=true`) a missing model is a failure, never a silent skip.
pub fn test_model_path() -> Option<PathBuf> {
    let path = std::env::var_os("INGOT_TEST_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let cache = std::env::var_os("INGOT_CACHE")
                .map(PathBuf::from)
                .unwrap_or_else(|| {
                    PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache/ingot")
                });
            cache.join("smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        });
    if path.is_file() {
        return Some(path);
    }
    let msg = format!(
        "test model not found at {}: run scripts/fetch-test-model",
        path.display()
    );
    if std::env::var("CI").is_ok_and(|v| v == "true" || v == "1") {
        panic!("{msg}");
    }
    eprintln!("SKIPPED: {msg}");
    None
}

/// The directory of the committed reference fixtures: `$INGOT_FIXTURES` (for test binaries
/// run away from the source tree, as on the GPU machine), else the repository's.
pub fn fixtures_dir() -> PathBuf {
    std::env::var_os("INGOT_FIXTURES")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/smollm2")
        })
}

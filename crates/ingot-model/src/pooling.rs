//! Pooling: how an embedding model turns a prompt's final hidden states into one vector,
//! as the model's files say (sentence-transformers' `modules.json` and `1_Pooling/`, or a
//! GGUF's `pooling_type`), and the finishing steps (mean, Matryoshka truncation, L2
//! normalization) applied to a pooled row on the host.

use crate::checkpoint::Checkpoint;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::path::Path;

/// Which hidden states make the vector: all are taken after the model's final norm, as
/// transformers' `last_hidden_state`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolingType {
    /// The last prompt token's (decoder embedding models: Qwen3-Embedding, E5-Mistral).
    Last,
    /// The mean over every prompt token.
    Mean,
    /// The first token's.
    Cls,
}

impl PoolingType {
    pub fn as_str(self) -> &'static str {
        match self {
            PoolingType::Last => "last-token",
            PoolingType::Mean => "mean",
            PoolingType::Cls => "CLS",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Pooling {
    pub kind: PoolingType,
    /// L2-normalize the vector (sentence-transformers' `Normalize` module).
    pub normalize: bool,
    /// Sizes a request's `dimensions` may truncate the vector to: `None` where the model
    /// was not trained for truncation (Matryoshka), empty where any size is allowed.
    pub matryoshka: Option<Vec<usize>>,
}

impl Pooling {
    /// What a decoder model without pooling files gets: its last token, normalized (as
    /// vLLM and llama.cpp do for such models).
    pub fn last_token() -> Pooling {
        Pooling {
            kind: PoolingType::Last,
            normalize: true,
            matryoshka: None,
        }
    }

    /// The pooling the checkpoint's files declare, or `None` where they declare none.
    pub fn declared(ckpt: &Checkpoint) -> Result<Option<Pooling>> {
        match ckpt {
            Checkpoint::Safetensors { dir, .. } | Checkpoint::Dummy { dir, .. } => {
                let mut pooling = sentence_transformers(dir)?;
                if let Some(p) = &mut pooling {
                    p.matryoshka = matryoshka(dir)?;
                }
                Ok(pooling)
            }
            Checkpoint::Gguf { file, .. } => {
                let arch = file
                    .get("general.architecture")
                    .and_then(|v| v.as_str())
                    .unwrap_or("llama");
                let Some(t) = file
                    .get(&format!("{arch}.pooling_type"))
                    .and_then(|v| v.as_u64())
                else {
                    return Ok(None);
                };
                // llama.cpp's enum llama_pooling_type; its server normalizes (L2) by default.
                let kind = match t {
                    0 => return Ok(None),
                    1 => PoolingType::Mean,
                    2 => PoolingType::Cls,
                    3 => PoolingType::Last,
                    other => bail!(
                        "GGUF pooling_type {other} is not supported (mean, CLS and last-token are)"
                    ),
                };
                Ok(Some(Pooling {
                    kind,
                    normalize: true,
                    matryoshka: None,
                }))
            }
        }
    }

    /// The embedding of a prompt of `num_tokens` tokens from its pooled row (for mean
    /// pooling, the sum of its rows), cut to `dimensions` where asked.
    pub fn finish(
        &self,
        mut v: Vec<f32>,
        num_tokens: usize,
        dimensions: Option<usize>,
    ) -> Vec<f32> {
        if self.kind == PoolingType::Mean {
            let n = num_tokens.max(1) as f32;
            v.iter_mut().for_each(|x| *x /= n);
        }
        if let Some(d) = dimensions {
            v.truncate(d);
        }
        if self.normalize {
            let norm = v.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
            // torch.nn.functional.normalize's eps.
            let scale = 1.0 / norm.max(1e-12);
            v.iter_mut().for_each(|x| *x = (*x as f64 * scale) as f32);
        }
        v
    }

    /// Checks a request's `dimensions` against the model (of `hidden` outputs).
    pub fn check_dimensions(&self, dimensions: usize, hidden: usize) -> Result<()> {
        let Some(allowed) = &self.matryoshka else {
            bail!("this model does not support `dimensions` (it declares no Matryoshka representation: `is_matryoshka` or `matryoshka_dimensions` in config.json)");
        };
        if dimensions == 0 || dimensions > hidden {
            bail!("`dimensions` must be between 1 and the model's {hidden}, got {dimensions}");
        }
        if !allowed.is_empty() && !allowed.contains(&dimensions) {
            bail!("`dimensions` must be one of {allowed:?} for this model, got {dimensions}");
        }
        Ok(())
    }
}

fn read_json(path: &Path) -> Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}

/// sentence-transformers' module list: a Transformer, a Pooling and optionally a Normalize.
fn sentence_transformers(dir: &Path) -> Result<Option<Pooling>> {
    let modules_path = dir.join("modules.json");
    if !modules_path.exists() {
        return Ok(None);
    }
    let modules = read_json(&modules_path)?;
    let modules = modules
        .as_array()
        .with_context(|| format!("{}: expected a list of modules", modules_path.display()))?;
    let mut pooling = None;
    let mut normalize = false;
    for m in modules {
        let kind = m.get("type").and_then(Value::as_str).unwrap_or_default();
        let path = m.get("path").and_then(Value::as_str).unwrap_or_default();
        match kind.rsplit('.').next().unwrap_or_default() {
            "Transformer" => {}
            "Pooling" => pooling = Some(pooling_config(&dir.join(path).join("config.json"))?),
            "Normalize" => normalize = true,
            other => bail!(
                "{}: the sentence-transformers module `{other}` is not supported (Transformer, Pooling and Normalize are)",
                modules_path.display()
            ),
        }
    }
    let Some(kind) = pooling else {
        bail!("{}: no Pooling module", modules_path.display());
    };
    Ok(Some(Pooling {
        kind,
        normalize,
        matryoshka: None,
    }))
}

fn pooling_config(path: &Path) -> Result<PoolingType> {
    let v = read_json(path)?;
    let on = |key: &str| v.get(key).and_then(Value::as_bool).unwrap_or(false);
    if v.get("include_prompt").and_then(Value::as_bool) == Some(false) {
        bail!(
            "{}: `include_prompt: false` is not supported",
            path.display()
        );
    }
    let modes = [
        ("pooling_mode_lasttoken", Some(PoolingType::Last)),
        ("pooling_mode_mean_tokens", Some(PoolingType::Mean)),
        ("pooling_mode_cls_token", Some(PoolingType::Cls)),
        ("pooling_mode_max_tokens", None),
        ("pooling_mode_mean_sqrt_len_tokens", None),
        ("pooling_mode_weightedmean_tokens", None),
    ];
    let set: Vec<_> = modes.iter().filter(|(k, _)| on(k)).collect();
    match set.as_slice() {
        [(_, Some(kind))] => Ok(*kind),
        [(key, None)] => bail!(
            "{}: `{key}` is not supported (last-token, mean and CLS pooling are)",
            path.display()
        ),
        [] => bail!("{}: no pooling mode is set", path.display()),
        _ => bail!(
            "{}: more than one pooling mode is set (concatenated poolings are not supported)",
            path.display()
        ),
    }
}

/// config.json's Matryoshka declaration, as vLLM reads it.
fn matryoshka(dir: &Path) -> Result<Option<Vec<usize>>> {
    let path = dir.join("config.json");
    if !path.exists() {
        return Ok(None);
    }
    let v = read_json(&path)?;
    if let Some(dims) = v.get("matryoshka_dimensions").and_then(Value::as_array) {
        let dims = dims
            .iter()
            .map(|d| d.as_u64().map(|d| d as usize))
            .collect::<Option<Vec<_>>>()
            .with_context(|| {
                format!("{}: matryoshka_dimensions must be integers", path.display())
            })?;
        return Ok(Some(dims));
    }
    Ok(v.get("is_matryoshka")
        .and_then(Value::as_bool)
        .unwrap_or(false)
        .then(Vec::new))
}

/// Writes sentence-transformers' files for `kind` pooling (with a Normalize module where
/// `normalize`) into a model directory: for synthetic test models and `configs/`.
pub fn write_sentence_transformers(
    dir: &Path,
    kind: PoolingType,
    normalize: bool,
    hidden: usize,
) -> Result<()> {
    let mut modules = vec![
        serde_json::json!({"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}),
        serde_json::json!({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}),
    ];
    if normalize {
        modules.push(serde_json::json!({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}));
    }
    std::fs::write(
        dir.join("modules.json"),
        serde_json::to_string_pretty(&modules)?,
    )?;
    std::fs::create_dir_all(dir.join("1_Pooling"))?;
    let config = serde_json::json!({
        "word_embedding_dimension": hidden,
        "pooling_mode_cls_token": kind == PoolingType::Cls,
        "pooling_mode_mean_tokens": kind == PoolingType::Mean,
        "pooling_mode_max_tokens": false,
        "pooling_mode_mean_sqrt_len_tokens": false,
        "pooling_mode_weightedmean_tokens": false,
        "pooling_mode_lasttoken": kind == PoolingType::Last,
        "include_prompt": true,
    });
    std::fs::write(
        dir.join("1_Pooling/config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    if normalize {
        std::fs::create_dir_all(dir.join("2_Normalize"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finishing_means_truncates_then_normalizes() {
        let p = Pooling {
            kind: PoolingType::Mean,
            normalize: true,
            matryoshka: Some(vec![]),
        };
        let v = p.finish(vec![6.0, 8.0, 100.0], 2, Some(2));
        assert_eq!(v, vec![0.6, 0.8]);
        let raw = Pooling {
            normalize: false,
            ..Pooling::last_token()
        };
        assert_eq!(raw.finish(vec![3.0, 4.0], 7, None), vec![3.0, 4.0]);
    }

    #[test]
    fn sentence_transformers_files_are_read_and_odd_ones_refused() {
        let dir = std::env::temp_dir().join(format!("ingot-pooling-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        write_sentence_transformers(&dir, PoolingType::Mean, false, 8).unwrap();
        let p = sentence_transformers(&dir).unwrap().unwrap();
        assert_eq!((p.kind, p.normalize), (PoolingType::Mean, false));
        write_sentence_transformers(&dir, PoolingType::Cls, true, 8).unwrap();
        let p = sentence_transformers(&dir).unwrap().unwrap();
        assert_eq!((p.kind, p.normalize), (PoolingType::Cls, true));
        let cfg = dir.join("1_Pooling/config.json");
        std::fs::write(&cfg, r#"{"pooling_mode_max_tokens": true}"#).unwrap();
        let e = sentence_transformers(&dir).unwrap_err().to_string();
        assert!(e.contains("pooling_mode_max_tokens"), "{e}");
        std::fs::write(
            dir.join("config.json"),
            r#"{"matryoshka_dimensions": [4, 8]}"#,
        )
        .unwrap();
        assert_eq!(matryoshka(&dir).unwrap(), Some(vec![4, 8]));
        let p = Pooling {
            matryoshka: Some(vec![4, 8]),
            ..Pooling::last_token()
        };
        assert!(p.check_dimensions(4, 8).is_ok());
        assert!(p.check_dimensions(5, 8).is_err());
        assert!(Pooling::last_token().check_dimensions(4, 8).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! Checkpoints published in FP8: e4m3 weights with their scales, turned into ingot's FP8
//! blocks ([`ingot_backend::quant::fp8`]: an f32 scale a 128 values of a row) as they are
//! read.
//!
//! Two conventions name them in `config.json`'s `quantization_config`: `quant_method: fp8`
//! (DeepSeek-V3's and Qwen3's FP8 releases: a `weight_scale_inv` a `weight_block_size` tile,
//! 128 × 128; vLLM's own: one `weight_scale` a tensor) and compressed-tensors' `float-quantized`
//! format (llm-compressor: a `weight_scale` a tensor, an output channel, a group of columns or
//! a tile). Each means value = e4m3 · scale, so every 128-value block of a row takes the one
//! scale its values share: the model is the checkpoint's, exactly. Activation scales
//! (`input_scale` of static schemes) are not read: ingot's activations stay 16-bit, which
//! is more precise than the FP8 activations they describe.

use anyhow::{bail, ensure, Result};
use ingot_backend::quant::fp8::BLOCK;
use ingot_backend::DType;

/// What `quantization_config` says of an FP8 checkpoint's scales.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Fp8Format {
    /// The rows and columns one scale covers, where the scales are tiles.
    pub tile: Option<[usize; 2]>,
}

/// The FP8 format of a checkpoint whose `config.json` is `config`: `None` without a
/// `quantization_config`, an error naming a method ingot does not read.
pub fn format_of(config: &serde_json::Value) -> Result<Option<Fp8Format>> {
    let Some(q) = config.get("quantization_config") else {
        return Ok(None);
    };
    let method = q.get("quant_method").and_then(|m| m.as_str()).unwrap_or("");
    let tile = |v: Option<&serde_json::Value>| -> Result<Option<[usize; 2]>> {
        match v {
            None | Some(serde_json::Value::Null) => Ok(None),
            Some(v) => match serde_json::from_value::<[usize; 2]>(v.clone()) {
                Ok(t) if t[0] > 0 && t[1] > 0 => Ok(Some(t)),
                _ => bail!("quantization_config: a block size of {v} is not [rows, columns]"),
            },
        }
    };
    match method {
        "fp8" => Ok(Some(Fp8Format {
            tile: tile(q.get("weight_block_size"))?,
        })),
        "compressed-tensors" => {
            let format = q.get("format").and_then(|f| f.as_str()).unwrap_or("");
            ensure!(
                format == "float-quantized",
                "quantization_config: compressed-tensors `{format}` checkpoints are not supported \
                 (ingot reads float-quantized ones: FP8 weights)"
            );
            let groups = q.get("config_groups").and_then(|g| g.as_object());
            let mut tiles = groups
                .into_iter()
                .flat_map(|g| g.values())
                .filter_map(|g| g.get("weights"))
                .map(|w| tile(w.get("block_structure")));
            Ok(Some(Fp8Format {
                tile: tiles.next().transpose()?.flatten(),
            }))
        }
        other => bail!(
            "quantization_config: `{other}` checkpoints are not supported (ingot reads fp8 and \
             compressed-tensors float-quantized ones; GGUF files for integer formats)"
        ),
    }
}

/// The e4m3 matrix `weight` of `shape` ([rows, columns]) with its scales (`scale`, of
/// `scale_shape`: a scalar, one a row, or a grid) as [`DType::Fp8`] blocks. `name` is the
/// weight's, for errors.
pub fn blocks(
    name: &str,
    weight: &[u8],
    shape: &[usize],
    scale: &[f32],
    scale_shape: &[usize],
    format: Fp8Format,
) -> Result<Vec<u8>> {
    let &[rows, cols] = shape else {
        bail!("{name}: an FP8 weight of shape {shape:?} is not a matrix");
    };
    ensure!(
        weight.len() == rows * cols,
        "{name}: {} bytes for shape {shape:?}",
        weight.len()
    );
    ensure!(
        cols.is_multiple_of(BLOCK),
        "{name}: {cols} columns are not whole {BLOCK}-value FP8 blocks"
    );
    let (sr, sc) = match *scale_shape {
        [] => (1, 1),
        [n] => (n, 1),
        [r, c] => (r, c),
        _ => bail!("{name}: scales of shape {scale_shape:?}"),
    };
    ensure!(
        sr * sc == scale.len() && sr > 0 && sc > 0,
        "{name}: {} scales for shape {scale_shape:?}",
        scale.len()
    );
    // The rows and columns one scale covers: the configured tiles where the scales are
    // their grid, else an even share of the matrix (the whole, a row, a group of columns).
    let (br, bc) = match format.tile {
        Some([tr, tc]) if sr == rows.div_ceil(tr) && sc == cols.div_ceil(tc) => (tr, tc),
        _ if rows.is_multiple_of(sr) && cols.is_multiple_of(sc) => (rows / sr, cols / sc),
        _ => bail!("{name}: scales of shape {scale_shape:?} do not tile a [{rows}, {cols}] matrix"),
    };
    ensure!(
        bc.is_multiple_of(BLOCK),
        "{name}: a scale a {bc} columns: ingot's FP8 blocks of {BLOCK} need a multiple of {BLOCK}"
    );
    let mut out = Vec::with_capacity(DType::Fp8.bytes_for(rows * cols));
    for (r, row) in weight.chunks_exact(cols).enumerate() {
        for (b, values) in row.chunks_exact(BLOCK).enumerate() {
            let s = scale[r / br * sc + b * BLOCK / bc];
            out.extend_from_slice(&s.to_le_bytes());
            out.extend_from_slice(values);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Each layout of scales lands on the blocks it covers; what cannot be expressed in
    /// 128-value blocks is refused.
    #[test]
    fn every_scale_layout_becomes_the_blocks_it_covers() {
        let (rows, cols) = (3, 256);
        let weight: Vec<u8> = (0..rows * cols).map(|i| (i % 126) as u8).collect();
        let scale_of = |out: &[u8], r: usize, b: usize| {
            let at = (r * cols / BLOCK + b) * 132;
            assert_eq!(
                out[at + 4..at + 132],
                weight[r * cols + b * BLOCK..][..BLOCK]
            );
            f32::from_le_bytes(out[at..at + 4].try_into().unwrap())
        };
        let plain = Fp8Format::default();
        let out = blocks("w", &weight, &[rows, cols], &[0.5], &[], plain).unwrap();
        assert!((0..rows).all(|r| (0..2).all(|b| scale_of(&out, r, b) == 0.5)));
        let out = blocks(
            "w",
            &weight,
            &[rows, cols],
            &[1.0, 2.0, 3.0],
            &[3, 1],
            plain,
        )
        .unwrap();
        assert!((0..rows).all(|r| (0..2).all(|b| scale_of(&out, r, b) == (r + 1) as f32)));
        let groups: Vec<f32> = (0..6).map(|i| i as f32).collect();
        let out = blocks("w", &weight, &[rows, cols], &groups, &[3, 2], plain).unwrap();
        assert!((0..rows).all(|r| (0..2).all(|b| scale_of(&out, r, b) == (2 * r + b) as f32)));
        let tiled = Fp8Format {
            tile: Some([128, 128]),
        };
        let out = blocks("w", &weight, &[rows, cols], &[7.0, 9.0], &[1, 2], tiled).unwrap();
        assert!((0..rows).all(|r| scale_of(&out, r, 0) == 7.0 && scale_of(&out, r, 1) == 9.0));
        let e = blocks("w", &weight, &[rows, cols], &[1.0; 12], &[3, 4], plain).unwrap_err();
        assert!(e.to_string().contains("a scale a 64 columns"), "{e}");
        let e = blocks("w", &weight[..rows * 64], &[rows, 64], &[1.0], &[], plain).unwrap_err();
        assert!(e.to_string().contains("not whole 128-value"), "{e}");
    }

    #[test]
    fn quantization_configs_are_read_or_refused_by_name() {
        assert_eq!(format_of(&json!({})).unwrap(), None);
        let deepseek = json!({"quantization_config": {"quant_method": "fp8",
            "weight_block_size": [128, 128], "activation_scheme": "dynamic"}});
        assert_eq!(
            format_of(&deepseek).unwrap().unwrap().tile,
            Some([128, 128])
        );
        let vllm = json!({"quantization_config": {"quant_method": "fp8"}});
        assert_eq!(format_of(&vllm).unwrap().unwrap().tile, None);
        let ct = json!({"quantization_config": {"quant_method": "compressed-tensors",
            "format": "float-quantized", "config_groups": {"group_0": {"weights":
            {"num_bits": 8, "type": "float", "strategy": "channel"}}}}});
        assert_eq!(format_of(&ct).unwrap().unwrap().tile, None);
        for (config, says) in [
            (
                json!({"quantization_config": {"quant_method": "awq"}}),
                "`awq`",
            ),
            (
                json!({"quantization_config": {"quant_method": "compressed-tensors",
                    "format": "pack-quantized"}}),
                "`pack-quantized`",
            ),
        ] {
            let e = format_of(&config).unwrap_err().to_string();
            assert!(e.contains(says), "{e}");
        }
    }
}

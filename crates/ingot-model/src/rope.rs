//! The rotary embedding table: cosines and sines per position, with the model's scaling.

use crate::config::{ModelConfig, RopeScaling};

/// Inverse frequencies, computed in f32 as HF transformers does so that angles agree
/// bit for bit at long positions.
pub fn inv_freq(cfg: &ModelConfig) -> Vec<f32> {
    let dim = cfg.head_dim;
    let base: Vec<f32> = (0..dim / 2)
        .map(|i| 1.0 / cfg.rope_theta.powf((2 * i) as f32 / dim as f32))
        .collect();
    match &cfg.rope_scaling {
        RopeScaling::None => base,
        RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
        RopeScaling::FreqFactors(d) => base.iter().zip(d).map(|(f, d)| f / d).collect(),
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position,
        } => {
            let old = *original_max_position as f32;
            let low_wavelen = old / low_freq_factor;
            let high_wavelen = old / high_freq_factor;
            base.iter()
                .map(|&f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
    }
}

/// `[max_positions, head_dim]`: per position, `head_dim / 2` cosines then as many sines.
pub fn cos_sin_table(cfg: &ModelConfig, max_positions: usize) -> Vec<f32> {
    let inv = inv_freq(cfg);
    let half = inv.len();
    let mut t = vec![0f32; max_positions * 2 * half];
    for (p, row) in t.chunks_mut(2 * half).enumerate() {
        for (i, &f) in inv.iter().enumerate() {
            let angle = p as f32 * f;
            row[i] = angle.cos();
            row[half + i] = angle.sin();
        }
    }
    t
}

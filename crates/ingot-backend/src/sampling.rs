//! Token selection from a row of logits, in the form a GPU runs it without sorting: sparse
//! edits (bias, penalties), a structured-output token mask, then greedy or a draw from the tempered distribution cut
//! by top-k, top-p and min-p.
//!
//! Thresholds are found on order-preserving integer keys of the logits, and probability
//! mass is summed in 2^-40 fixed point, so every sum is exact and independent of the order
//! of additions: a kernel that follows [`sample_row`] picks the same token for the same
//! uniform draw on any launch shape. The draw walks the kept tokens in id order.

use bytemuck::{Pod, Zeroable};

/// One row's parameters, laid out as the kernels read them.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Pod, Zeroable)]
pub struct SampleRow {
    /// 0 takes the argmax of the edited logits (the first among equals).
    pub temperature: f32,
    /// Keep the `top_k` largest logits (all that equal the k-th too); 0 keeps all.
    pub top_k: u32,
    /// Keep the most likely tokens until their mass reaches `top_p` (all equal to the last).
    pub top_p: f32,
    /// Keep tokens at least `min_p` times as likely as the most likely one.
    pub min_p: f32,
    /// The request's uniform draw in [0, 1).
    pub uniform: f32,
    /// This row's edits are `edits[edit_start..edit_end]`, at most one per token.
    pub edit_start: u32,
    pub edit_end: u32,
    /// 1 + the index of this row's token bitmask in the step's masks, or 0 for a row
    /// without one. A mask is [`mask_words`] words; bit `t % 32` of word `t / 32` set
    /// allows token `t`.
    pub mask: u32,
}

/// Words of one row's token bitmask over a vocabulary of `vocab`.
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// Sets the logits of the tokens `mask` forbids to −∞ (tokens past the mask's end are
/// forbidden).
pub fn apply_mask(logits: &mut [f32], mask: &[u32]) {
    for (w, chunk) in logits.chunks_mut(32).enumerate() {
        let bits = mask.get(w).copied().unwrap_or(0);
        if bits == u32::MAX {
            continue;
        }
        for (b, x) in chunk.iter_mut().enumerate() {
            if bits & (1 << b) == 0 {
                *x = f32::NEG_INFINITY;
            }
        }
    }
}

/// One logit's change: `x = x + bias`, then `x / repetition` if positive or
/// `x * repetition` if not, then `x - subtract` (infinity masks the token).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Pod, Zeroable)]
pub struct LogitEdit {
    pub token: u32,
    pub bias: f32,
    pub repetition: f32,
    pub subtract: f32,
}

impl LogitEdit {
    pub fn new(token: u32) -> LogitEdit {
        LogitEdit {
            token,
            bias: 0.0,
            repetition: 1.0,
            subtract: 0.0,
        }
    }

    pub fn apply(&self, x: f32) -> f32 {
        let x = x + self.bias;
        let x = if x > 0.0 {
            x / self.repetition
        } else {
            x * self.repetition
        };
        x - self.subtract
    }
}

/// Fixed-point scale of probability mass: relative probabilities in units of 2^-40.
pub const MASS_SCALE: f32 = (1u64 << 40) as f32;

/// An integer key with the order of the floats (for non-NaN values).
pub fn order_key(x: f32) -> u32 {
    let b = x.to_bits();
    if b & 0x8000_0000 != 0 {
        !b
    } else {
        b | 0x8000_0000
    }
}

fn mass(prob: f32) -> u64 {
    (prob * MASS_SCALE) as u64
}

/// `floor(total × frac)` for `frac` in [0, 1], exact: the top-p and draw targets, in
/// integer arithmetic that a GPU without 64-bit floats does the same way.
pub fn scaled(total: u64, frac: f32) -> u64 {
    if frac >= 1.0 {
        return total;
    }
    if frac.is_nan() || frac <= 0.0 {
        return 0;
    }
    // frac = m · 2^-shift with m < 2^24; shift ≥ 24 below 1.
    let bits = frac.to_bits();
    let e = bits >> 23;
    let (m, shift) = if e == 0 {
        (bits & 0x7f_ffff, 149)
    } else {
        ((bits & 0x7f_ffff) | 0x80_0000, 150 - e)
    };
    (u128::from(total) * u128::from(m))
        .checked_shr(shift)
        .map_or(0, |v| v as u64)
}

/// Applies `edits`, then `mask` if given, to `logits` and picks the row's token. A draw
/// leaves `logits` holding the probabilities relative to the most likely token,
/// `exp((x - max) / temperature)`, which its thresholds and masses are computed from.
pub fn sample_row(
    logits: &mut [f32],
    row: &SampleRow,
    edits: &[LogitEdit],
    mask: Option<&[u32]>,
) -> u32 {
    for e in edits {
        let x = &mut logits[e.token as usize];
        *x = e.apply(*x);
    }
    if let Some(mask) = mask {
        apply_mask(logits, mask);
    }
    let best = crate::first_argmax(logits);
    if row.temperature == 0.0 {
        return best;
    }
    let max = logits[best as usize];
    let inv_t = 1.0 / row.temperature;
    for x in logits.iter_mut() {
        *x = ((*x - max) * inv_t).exp();
    }
    draw(logits, row, best)
}

/// The token a draw with `row`'s top-k, top-p, min-p and uniform picks from relative
/// probabilities `probs` (the most likely token at 1); `best` where every token is masked.
/// Integer keys and masses only, so a device that computed the same probabilities picks the
/// same token.
pub fn draw(probs: &[f32], row: &SampleRow, best: u32) -> u32 {
    let k = row.top_k as usize;
    let kth = if k > 0 && k < probs.len() {
        let mut keys: Vec<u32> = probs.iter().map(|&p| order_key(p)).collect();
        *keys
            .select_nth_unstable_by_key(k - 1, |&key| std::cmp::Reverse(key))
            .1
    } else {
        0
    };
    let mut threshold = kth;
    if row.top_p < 1.0 {
        let total: u64 = probs.iter().map(|&p| mass(p)).sum();
        let target = scaled(total, row.top_p).max(1);
        let mut by_key: Vec<(u32, u64)> = probs
            .iter()
            .map(|&p| (order_key(p), mass(p)))
            .filter(|&(key, _)| key >= kth)
            .collect();
        by_key.sort_unstable_by_key(|&(key, _)| std::cmp::Reverse(key));
        let mut acc = 0;
        for (key, m) in by_key {
            acc += m;
            if acc >= target {
                threshold = threshold.max(key);
                break;
            }
        }
    }
    let kept = |p: f32| order_key(p) >= threshold && p >= row.min_p;
    let total: u64 = probs.iter().filter(|&&p| kept(p)).map(|&p| mass(p)).sum();
    if total == 0 {
        // Every token masked: nothing to draw from.
        return best;
    }
    let target = scaled(total, row.uniform).min(total - 1);
    let mut acc = 0;
    for (i, &p) in probs.iter().enumerate() {
        if kept(p) {
            acc += mass(p);
            if acc > target {
                return i as u32;
            }
        }
    }
    best
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(temperature: f32) -> SampleRow {
        SampleRow {
            temperature,
            top_p: 1.0,
            ..Default::default()
        }
    }

    #[test]
    fn scaled_is_the_exact_floor_of_the_product() {
        let total = (1u64 << 57) + 12_345_678_901;
        for frac in [1e-10, 2f32.powi(-24), 0.3, 0.5, 0.9, 0.999_999_9] {
            // These fractions times 2^64 are integers, and total times those fits a u128.
            let exact = (u128::from(total) * (f64::from(frac) * 2f64.powi(64)) as u128) >> 64;
            assert_eq!(u128::from(scaled(total, frac)), exact, "{frac}");
        }
        assert_eq!(scaled(total, 1e-30), 0);
        assert_eq!(scaled(total, 1e-45), 0);
        assert_eq!(scaled(total, 0.0), 0);
        assert_eq!(scaled(total, 1.0), total);
        assert_eq!(scaled(7, 0.5), 3);
    }

    #[test]
    fn keys_keep_the_order_of_floats() {
        let xs = [
            f32::NEG_INFINITY,
            -3.5,
            -0.0,
            0.0,
            1e-30,
            2.0,
            f32::INFINITY,
        ];
        for w in xs.windows(2) {
            assert!(order_key(w[0]) <= order_key(w[1]), "{w:?}");
        }
    }

    #[test]
    fn the_draw_follows_the_cumulative_mass_in_id_order() {
        let ln = |p: f32| p.ln();
        let logits = [ln(0.1), ln(0.4), ln(0.2), ln(0.3)];
        let pick = |u: f32, r: SampleRow| {
            sample_row(
                &mut logits.clone(),
                &SampleRow { uniform: u, ..r },
                &[],
                None,
            )
        };
        let r = row(1.0);
        assert_eq!(
            [0.05, 0.15, 0.45, 0.55, 0.75, 0.99].map(|u| pick(u, r)),
            [0, 1, 1, 2, 3, 3]
        );
        // top_k 2 keeps ids 1 and 3 (0.4 and 0.3): 4/7 and 3/7 of the kept mass.
        let k2 = SampleRow { top_k: 2, ..r };
        assert_eq!([0.5, 0.6].map(|u| pick(u, k2)), [1, 3]);
        // top_p 0.6 keeps 0.4 + 0.3; min_p 0.6 keeps what is at least 0.24.
        let p = SampleRow { top_p: 0.6, ..r };
        assert_eq!([0.0, 0.56, 0.58].map(|u| pick(u, p)), [1, 1, 3]);
        let m = SampleRow { min_p: 0.6, ..r };
        assert_eq!([0.0, 0.99].map(|u| pick(u, m)), [1, 3]);
        assert_eq!(pick(0.7, row(0.0)), 1);
    }

    #[test]
    fn edits_bias_penalise_and_mask() {
        let mut logits = vec![1.0, 2.0, -1.0, 0.5];
        let edits = [
            LogitEdit {
                repetition: 2.0,
                ..LogitEdit::new(1)
            },
            LogitEdit {
                repetition: 2.0,
                ..LogitEdit::new(2)
            },
            LogitEdit {
                subtract: f32::INFINITY,
                ..LogitEdit::new(0)
            },
            LogitEdit {
                bias: 0.75,
                ..LogitEdit::new(3)
            },
        ];
        assert_eq!(sample_row(&mut logits, &row(0.0), &edits, None), 3);
        assert_eq!(logits, [f32::NEG_INFINITY, 1.0, -2.0, 1.25]);
    }

    #[test]
    fn a_mask_leaves_only_its_tokens() {
        let logits: Vec<f32> = (0..70).map(|i| (i as f32 * 0.7).sin()).collect();
        // Tokens 3, 40 and 65 allowed, in three words.
        let mask = [1 << 3, 1 << 8, 1 << 1];
        let allowed = [3, 40, 65];
        let best = *allowed
            .iter()
            .max_by(|&&a, &&b| logits[a as usize].total_cmp(&logits[b as usize]))
            .unwrap();
        let pick = |r: SampleRow| sample_row(&mut logits.clone(), &r, &[], Some(&mask));
        assert_eq!(pick(row(0.0)), best);
        let mut seen = vec![];
        for u in [0.0, 0.2, 0.4, 0.6, 0.8, 0.99] {
            let t = pick(SampleRow {
                uniform: u,
                ..row(2.0)
            });
            assert!(allowed.contains(&t), "{t}");
            seen.push(t);
        }
        seen.dedup();
        assert_eq!(
            seen, allowed,
            "a hot draw reaches every allowed token in id order"
        );
        // Tokens past a short mask's end are forbidden.
        let mut short = logits.clone();
        apply_mask(&mut short, &[u32::MAX, u32::MAX]);
        assert!(short[64..].iter().all(|&x| x == f32::NEG_INFINITY));
        assert_eq!(short[..64], logits[..64]);
    }
}

//! Picking the next token from logits: greedy at temperature 0, otherwise a draw from the
//! tempered softmax with a per-request seeded RNG.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

pub struct Sampler {
    temperature: f32,
    rng: StdRng,
}

/// Index of the largest logit (the first on ties, as `torch.argmax`).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best as u32
}

impl Sampler {
    pub fn new(temperature: f32, seed: Option<u64>) -> anyhow::Result<Sampler> {
        anyhow::ensure!(
            temperature.is_finite() && temperature >= 0.0,
            "temperature must be a finite number >= 0, got {temperature}"
        );
        let rng = match seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Ok(Sampler { temperature, rng })
    }

    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.temperature == 0.0 {
            return argmax(logits);
        }
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let probs: Vec<f32> = logits
            .iter()
            .map(|&l| ((l - max) / self.temperature).exp())
            .collect();
        let total: f32 = probs.iter().sum();
        let mut r = self.rng.random::<f32>() * total;
        for (i, &p) in probs.iter().enumerate() {
            if r < p {
                return i as u32;
            }
            r -= p;
        }
        argmax(logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_first_maximum_and_seed_reproduces() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let draw = |seed| {
            let mut s = Sampler::new(0.8, Some(seed)).unwrap();
            (0..20).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        assert!(Sampler::new(-1.0, None).is_err());
    }
}

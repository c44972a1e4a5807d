//! Per-request token selection: logits processors (bias, penalties, min_tokens), then
//! greedy or a draw from the tempered, filtered distribution with the request's own RNG.

use crate::structured::Constraint;
use ingot_backend::{LogitEdit, SampleRow};
use ingot_core::SamplingParams;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// The chosen token's log-probability and the most likely alternatives, from the model's
/// own distribution (before temperature and penalties, as vLLM reports them).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// Index of the largest logit (the first on ties, as `torch.argmax`).
pub use ingot_backend::first_argmax as argmax;

fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|&l| (l - max).exp()).sum::<f32>().ln();
    logits.iter().map(|&l| l - lse).collect()
}

/// Ids of the `k` largest values, largest first (ties by lower id).
fn top_k_ids(values: &[f32], k: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = (0..values.len() as u32).collect();
    let k = k.min(ids.len());
    let cmp = |a: &u32, b: &u32| {
        values[*b as usize]
            .total_cmp(&values[*a as usize])
            .then(a.cmp(b))
    };
    if k < ids.len() && k > 0 {
        ids.select_nth_unstable_by(k - 1, cmp);
    }
    ids.truncate(k);
    ids.sort_by(cmp);
    ids
}

pub struct Sampler {
    params: SamplingParams,
    /// Ids that end generation (EOS unless ignored, plus stop_token_ids).
    stop_ids: Vec<u32>,
    rng: StdRng,
}

impl Sampler {
    /// `stream` separates the samples of one request (`n > 1`) that share a seed.
    pub fn new(params: SamplingParams, eos_ids: &[u32], stream: u64) -> Sampler {
        let rng = match params.seed {
            Some(s) => {
                StdRng::seed_from_u64(s.wrapping_add(stream.wrapping_mul(0x9E37_79B9_7F4A_7C15)))
            }
            None => StdRng::from_os_rng(),
        };
        let mut stop_ids = params.stop_token_ids.clone();
        if !params.ignore_eos {
            stop_ids.extend_from_slice(eos_ids);
        }
        Sampler {
            params,
            stop_ids,
            rng,
        }
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Whether this sample's next token is the plain argmax of the model's logits: greedy,
    /// with no processor that changes logits and no logprobs to report.
    pub fn is_plain_greedy(&self, num_output: usize) -> bool {
        let p = &self.params;
        p.is_greedy()
            && p.logprobs.is_none()
            && p.logit_bias.is_empty()
            && p.repetition_penalty == 1.0
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
            && (num_output >= p.min_tokens || self.stop_ids.is_empty())
    }

    /// Whether `token` ends the sequence (once `min_tokens` are out).
    pub fn is_stop_token(&self, token: u32) -> bool {
        self.stop_ids.contains(&token)
    }

    /// Picks the next token of a sequence whose tokens so far are `tokens`, of which the
    /// last `num_output` were generated, among those `constraint` allows. `logits` is
    /// modified in place. Fails only when the constraint has no mask to give.
    pub fn sample(
        &mut self,
        logits: &mut [f32],
        tokens: &[u32],
        num_output: usize,
        constraint: Option<&Constraint>,
    ) -> anyhow::Result<(u32, Option<TokenLogprobs>)> {
        let p = &self.params;
        let raw_logprobs = p.logprobs.map(|_| log_softmax(logits));
        for e in self.logit_edits(tokens, num_output) {
            let x = &mut logits[e.token as usize];
            *x = e.apply(*x);
        }
        if let Some(c) = constraint {
            c.apply(logits)?;
        }
        let (greedy, top_n) = (p.is_greedy(), p.logprobs.unwrap_or(0));
        let token = if greedy {
            argmax(logits)
        } else {
            self.draw(logits)
        };
        let logprobs = raw_logprobs.map(|lp| TokenLogprobs {
            token,
            logprob: lp[token as usize],
            top: top_k_ids(&lp, top_n)
                .into_iter()
                .map(|i| (i, lp[i as usize]))
                .collect(),
        });
        Ok((token, logprobs))
    }

    /// The logits processors for the next token of a sequence whose tokens so far are
    /// `tokens` (the last `num_output` generated), as one edit per token: logit bias, stop
    /// ids masked before `min_tokens`, the repetition penalty on every token seen, and the
    /// presence and frequency penalties on output tokens.
    fn logit_edits(&self, tokens: &[u32], num_output: usize) -> Vec<LogitEdit> {
        let p = &self.params;
        let mut by_token: HashMap<u32, LogitEdit> = HashMap::new();
        for (&id, &bias) in &p.logit_bias {
            by_token.entry(id).or_insert(LogitEdit::new(id)).bias = bias;
        }
        if num_output < p.min_tokens {
            for &id in &self.stop_ids {
                by_token.entry(id).or_insert(LogitEdit::new(id)).subtract = f32::INFINITY;
            }
        }
        if p.repetition_penalty != 1.0 {
            for &id in tokens {
                by_token.entry(id).or_insert(LogitEdit::new(id)).repetition = p.repetition_penalty;
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let mut counts: HashMap<u32, u32> = HashMap::new();
            for &t in &tokens[tokens.len() - num_output..] {
                *counts.entry(t).or_default() += 1;
            }
            for (id, c) in counts {
                by_token.entry(id).or_insert(LogitEdit::new(id)).subtract +=
                    p.presence_penalty + p.frequency_penalty * c as f32;
            }
        }
        by_token.into_values().collect()
    }

    /// The same choice as [`sample`](Self::sample) (without logprobs), described for
    /// [`ingot_backend::Backend::sample`]: this row's parameters, with its logits
    /// processors appended to `edits`. A draw takes one number from the request's random
    /// stream, as on the host, so seeds reproduce.
    pub fn device_row(
        &mut self,
        tokens: &[u32],
        num_output: usize,
        edits: &mut Vec<LogitEdit>,
    ) -> SampleRow {
        let edit_start = edits.len() as u32;
        edits.extend(self.logit_edits(tokens, num_output));
        let p = &self.params;
        let greedy = p.is_greedy();
        SampleRow {
            temperature: if greedy { 0.0 } else { p.temperature },
            top_k: p.top_k.max(0) as u32,
            top_p: p.top_p,
            min_p: p.min_p,
            uniform: if greedy { 0.0 } else { self.rng.random() },
            edit_start,
            edit_end: edits.len() as u32,
            mask: 0,
        }
    }

    /// The tokens a draw chooses among, most likely first, with their probabilities.
    fn candidates(&self, logits: &[f32]) -> (Vec<u32>, Vec<f32>) {
        let p = &self.params;
        let max = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let mut probs: Vec<f32> = logits
            .iter()
            .map(|&l| ((l - max) / p.temperature).exp())
            .collect();
        let total: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= total);
        let top_k = if p.top_k > 0 {
            p.top_k as usize
        } else {
            probs.len()
        };
        // Candidates in descending probability, cut by top_k, then top_p, then min_p.
        let mut cand: Vec<u32> = if top_k < probs.len() || p.top_p < 1.0 {
            top_k_ids(&probs, top_k)
        } else {
            (0..probs.len() as u32).collect()
        };
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = cand
                .iter()
                .position(|&i| {
                    acc += probs[i as usize];
                    acc >= p.top_p
                })
                .map_or(cand.len(), |pos| pos + 1);
            cand.truncate(keep);
        }
        if p.min_p > 0.0 {
            let floor = p.min_p * cand.iter().map(|&i| probs[i as usize]).fold(0.0, f32::max);
            cand.retain(|&i| probs[i as usize] >= floor);
        }
        (cand, probs)
    }

    fn draw(&mut self, logits: &[f32]) -> u32 {
        let (cand, probs) = self.candidates(logits);
        let mass: f32 = cand.iter().map(|&i| probs[i as usize]).sum();
        let mut r = self.rng.random::<f32>() * mass;
        for &i in &cand {
            r -= probs[i as usize];
            if r < 0.0 {
                return i;
            }
        }
        *cand.last().expect("at least one candidate")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        (0..50).map(|i| (i as f32 * 0.37).sin() * 3.0).collect()
    }

    #[test]
    fn greedy_takes_first_maximum_and_a_seed_reproduces() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, -1.0]), 1);
        let draw = |seed, stream| {
            let params = SamplingParams {
                temperature: 0.8,
                top_p: 0.9,
                seed: Some(seed),
                ..Default::default()
            };
            let mut s = Sampler::new(params, &[], stream);
            (0..30)
                .map(|_| s.sample(&mut logits(), &[], 0, None).unwrap().0)
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7, 0), draw(7, 0));
        assert_ne!(draw(7, 0), draw(8, 0));
        assert_ne!(draw(7, 0), draw(7, 1));
    }

    #[test]
    fn filters_restrict_the_candidates() {
        let l = logits();
        let best = top_k_ids(&l, 3);
        let params = SamplingParams {
            temperature: 1.0,
            top_k: 3,
            seed: Some(1),
            ..Default::default()
        };
        let mut s = Sampler::new(params, &[], 0);
        for _ in 0..200 {
            assert!(best.contains(&s.sample(&mut l.clone(), &[], 0, None).unwrap().0));
        }
        let params = SamplingParams {
            temperature: 1.0,
            top_p: 1e-6,
            seed: Some(1),
            ..Default::default()
        };
        let mut s = Sampler::new(params, &[], 0);
        assert_eq!(
            s.sample(&mut l.clone(), &[], 0, None).unwrap().0,
            argmax(&l)
        );
        let params = SamplingParams {
            temperature: 1.0,
            min_p: 1.0,
            seed: Some(1),
            ..Default::default()
        };
        let mut s = Sampler::new(params, &[], 0);
        assert_eq!(
            s.sample(&mut l.clone(), &[], 0, None).unwrap().0,
            argmax(&l)
        );
    }

    #[test]
    fn processors_shift_the_choice() {
        let l = logits();
        let top = argmax(&l);
        let mut bias = SamplingParams::greedy(4);
        bias.logit_bias = [(0, 100.0)].into();
        assert_eq!(
            Sampler::new(bias, &[], 0)
                .sample(&mut l.clone(), &[], 0, None)
                .unwrap()
                .0,
            0
        );
        let rep = SamplingParams {
            repetition_penalty: 100.0,
            ..SamplingParams::greedy(4)
        };
        assert_ne!(
            Sampler::new(rep, &[], 0)
                .sample(&mut l.clone(), &[top], 1, None)
                .unwrap()
                .0,
            top
        );
        let pres = SamplingParams {
            presence_penalty: 2.0,
            frequency_penalty: 2.0,
            ..SamplingParams::greedy(4)
        };
        let mut l2 = l.clone();
        l2[top as usize] = l[top as usize] - 0.5;
        let second = argmax(&l2);
        l2[top as usize] = l[top as usize];
        // Penalised once as an output token, the top choice falls below the runner-up.
        let got = Sampler::new(pres, &[], 0)
            .sample(&mut l2, &[top, top], 2, None)
            .unwrap()
            .0;
        assert!(got != top || l[top as usize] - 6.0 > l[second as usize]);
        let min = SamplingParams {
            min_tokens: 2,
            ..SamplingParams::greedy(4)
        };
        let mut s = Sampler::new(min, &[top], 0);
        assert_ne!(
            s.sample(&mut l.clone(), &[], 0, None).unwrap().0,
            top,
            "EOS is masked before min_tokens"
        );
        assert!(s.is_stop_token(top));
    }

    #[test]
    fn logprobs_of_the_greedy_token_are_the_maximum() {
        let params = SamplingParams {
            logprobs: Some(5),
            ..SamplingParams::greedy(4)
        };
        let (tok, lp) = Sampler::new(params, &[], 0)
            .sample(&mut logits(), &[], 0, None)
            .unwrap();
        let lp = lp.unwrap();
        assert_eq!(lp.token, tok);
        assert_eq!(lp.top.len(), 5);
        assert_eq!(lp.top[0], (tok, lp.logprob));
        assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
        let total: f32 = log_softmax(&logits()).iter().map(|l| l.exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }

    /// The device path (edits + [`ingot_backend::sampling::sample_row`]) makes the host
    /// sampler's choice: the same processed logits, and draws spread over the same
    /// candidates in proportion to their probabilities.
    #[test]
    fn device_rows_choose_as_the_host_sampler() {
        use ingot_backend::sampling::sample_row;
        use rand::Rng;
        let mut rng = StdRng::seed_from_u64(3);
        let vocab = 300;
        for case in 0..24 {
            let params = SamplingParams {
                temperature: [0.0, 0.5, 1.0, 1.3][case % 4],
                top_k: [0, 1, 7, 40][(case / 4) % 4],
                top_p: [1.0, 0.8, 0.3][case % 3],
                min_p: [0.0, 0.1][(case / 2) % 2],
                repetition_penalty: [1.0, 1.3][case % 2],
                presence_penalty: 0.4,
                frequency_penalty: 0.2,
                logit_bias: [(5, 3.0), (17, -4.0)].into(),
                min_tokens: 3,
                seed: Some(case as u64),
                ..Default::default()
            };
            let logits: Vec<f32> = (0..vocab).map(|_| rng.random_range(-5.0..5.0)).collect();
            let tokens: Vec<u32> = (0..20).map(|_| rng.random_range(0..vocab as u32)).collect();
            let num_output = 1 + case % 5;
            let eos = [2];
            let mut host = Sampler::new(params.clone(), &eos, 0);
            let mut host_logits = logits.clone();
            let host_token = host
                .sample(&mut host_logits, &tokens, num_output, None)
                .unwrap()
                .0;
            let mut device = Sampler::new(params.clone(), &eos, 0);
            let mut edits = vec![];
            let row = device.device_row(&tokens, num_output, &mut edits);
            let mut device_logits = logits.clone();
            let edited_only = SampleRow {
                temperature: 0.0,
                ..row
            };
            sample_row(&mut device_logits, &edited_only, &edits, None);
            assert_eq!(device_logits, host_logits, "case {case}: processed logits");
            let token = sample_row(&mut logits.clone(), &row, &edits, None);
            if params.is_greedy() {
                assert_eq!(token, host_token, "case {case}");
                continue;
            }
            let (cand, probs) = host.candidates(&host_logits);
            let mass: f32 = cand.iter().map(|&i| probs[i as usize]).sum();
            let draws = 4000;
            let mut seen = vec![0usize; vocab];
            for k in 0..draws {
                let u = (k as f32 + 0.5) / draws as f32;
                let mut l = logits.clone();
                seen[sample_row(&mut l, &SampleRow { uniform: u, ..row }, &edits, None)
                    as usize] += 1;
            }
            for (t, &n) in seen.iter().enumerate() {
                let want = if cand.contains(&(t as u32)) {
                    probs[t] / mass
                } else {
                    0.0
                };
                let got = n as f32 / draws as f32;
                assert!(
                    (got - want).abs() <= 2.0 / draws as f32,
                    "case {case}, token {t}: drawn {got}, probability {want}"
                );
            }
        }
    }
}

//! Choosing a token from logits, as mlx-lm's `make_sampler` does: greedy at temperature 0,
//! otherwise top-p, then min-p, then top-k on the log-probabilities, then a draw at the
//! temperature. Every draw uses a key derived from (seed, step) alone, where step is the index
//! of the output token: any path to the same output position (plain decoding, or the verify
//! pass of speculative decoding) draws with the same noise and so picks the same token.

use mlx_rs::error::Exception;
use mlx_rs::Array;

#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Nucleus mass in (0, 1); 1 or 0 disables it.
    pub top_p: f32,
    /// 0 disables it.
    pub top_k: u32,
    /// 0 disables it.
    pub min_p: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams { temperature: 0.0, top_p: 1.0, top_k: 0, min_p: 0.0, seed: 0 }
    }
}

impl SamplingParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// One line naming the first parameter out of range, if any.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!("temperature must be a finite number >= 0, got {}", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1] (1 = off), got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum SampleError {
    /// NaN or infinite logits: broken weights or an overflow; no token can be chosen.
    #[error("the target's logits are NaN or infinite")]
    NonFinite,
    #[error(transparent)]
    Mlx(#[from] Exception),
}

/// Evaluates `result` together with one reduction over `logits`, so the check costs no extra
/// round trip to the device.
fn check_finite_on_device(logits: &Array, result: &Array) -> Result<(), SampleError> {
    let finite = logits.is_finite()?.all(None)?;
    mlx_rs::transforms::eval([result, &finite])?;
    if finite.item_exact::<bool>() {
        Ok(())
    } else {
        Err(SampleError::NonFinite)
    }
}

fn check_finite(logits: &[f32]) -> Result<(), SampleError> {
    if logits.iter().all(|x| x.is_finite()) {
        Ok(())
    } else {
        Err(SampleError::NonFinite)
    }
}

/// The token for output position `step`, from that position's logits [V] (or [1, .., V]).
pub fn sample(logits: &Array, params: &SamplingParams, step: u64) -> Result<u32, SampleError> {
    if params.is_greedy() {
        let row = logits.reshape(&[-1])?;
        let best = mlx_rs::ops::indexing::argmax_axis(&row, 0, None)?;
        check_finite_on_device(&row, &best)?;
        return Ok(best.item_exact::<u32>());
    }
    let row = logits.reshape(&[-1])?.as_dtype(mlx_rs::Dtype::Float32)?;
    check_finite(row.as_slice::<f32>())?;
    let logprobs = filtered_logprobs(row.as_slice::<f32>(), params);
    Ok(gumbel_argmax(&logprobs, params.temperature, params.seed, step))
}

/// The target's tokens over a verify window's logits [W, V], read back from MLX once. Position i
/// is output step `first_step + i`; its token is what [`sample`] would give there.
pub enum WindowTokens {
    /// Greedy: every position's argmax, computed on the device.
    Greedy(Vec<u32>),
    /// Sampled: the logits on the host, each position drawn when asked.
    Sampled { logits: Vec<f32>, vocab: usize },
}

impl WindowTokens {
    pub fn new(logits: &Array, params: &SamplingParams) -> Result<WindowTokens, SampleError> {
        if params.is_greedy() {
            let best = mlx_rs::ops::indexing::argmax_axis(logits, -1, None)?.as_dtype(mlx_rs::Dtype::Uint32)?;
            check_finite_on_device(logits, &best)?;
            return Ok(WindowTokens::Greedy(best.as_slice::<u32>().to_vec()));
        }
        let vocab = *logits.shape().last().unwrap_or(&1) as usize;
        let host = logits.as_dtype(mlx_rs::Dtype::Float32)?;
        check_finite(host.as_slice::<f32>())?;
        Ok(WindowTokens::Sampled { logits: host.as_slice::<f32>().to_vec(), vocab })
    }

    /// The logits of position `i` (sampled windows only).
    pub fn row(&self, i: usize) -> Option<&[f32]> {
        match self {
            WindowTokens::Greedy(_) => None,
            WindowTokens::Sampled { logits, vocab } => Some(&logits[i * vocab..(i + 1) * vocab]),
        }
    }

    pub fn token(&self, i: usize, params: &SamplingParams, step: u64) -> u32 {
        match self {
            WindowTokens::Greedy(best) => best[i],
            WindowTokens::Sampled { .. } => {
                let lp = filtered_logprobs(self.row(i).expect("sampled"), params);
                gumbel_argmax(&lp, params.temperature, params.seed, step)
            }
        }
    }
}

/// Log-probabilities with the filters applied (removed tokens at -inf), before temperature.
pub fn filtered_logprobs(logits: &[f32], params: &SamplingParams) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let log_sum = logits.iter().map(|&x| ((x - max) as f64).exp()).sum::<f64>().ln() as f32 + max;
    let mut lp: Vec<f32> = logits.iter().map(|&x| x - log_sum).collect();
    if params.top_p > 0.0 && params.top_p < 1.0 {
        top_p(&mut lp, params.top_p);
    }
    if params.min_p > 0.0 {
        let best = lp.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let threshold = best + params.min_p.ln();
        lp.iter_mut().filter(|x| **x < threshold).for_each(|x| *x = f32::NEG_INFINITY);
    }
    let k = params.top_k as usize;
    if k > 0 && k < lp.len() {
        let mut sorted = lp.clone();
        sorted.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
        let kth = sorted[k - 1];
        // Ties at the k-th value: keep the first ones, so exactly k remain.
        let mut above = lp.iter().filter(|&&x| x > kth).count();
        for x in lp.iter_mut() {
            if *x < kth || (*x == kth && above >= k) {
                *x = f32::NEG_INFINITY;
            } else if *x == kth {
                above += 1;
            }
        }
    }
    lp
}

/// Keeps the smallest set of most likely tokens whose mass reaches `p`.
///
/// Only the tokens that can be in that set are sorted: all tokens at or above a cut form a
/// prefix of the sorted order, so once their mass reaches `p` the set lies among them. A real
/// vocabulary (262,144 tokens) then costs one pass and a sort of a few hundred, not a sort of
/// all of it; the set, and the order in which its mass is summed, are those of a full sort.
fn top_p(lp: &mut [f32], p: f32) {
    let best = lp.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut cut = best - 8.0;
    let mut candidates: Vec<usize> = loop {
        let above: Vec<usize> = (0..lp.len()).filter(|&t| lp[t] >= cut).collect();
        let mass: f64 = above.iter().map(|&t| (lp[t] as f64).exp()).sum();
        if mass >= p as f64 || above.len() == lp.len() {
            break above;
        }
        cut = if cut > best - 64.0 { cut - 8.0 } else { f32::NEG_INFINITY };
    };
    candidates.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]));
    let mut mass = 0.0f64;
    let mut keep = candidates.len();
    for (i, &t) in candidates.iter().enumerate() {
        mass += (lp[t] as f64).exp();
        if mass >= p as f64 {
            keep = i + 1;
            break;
        }
    }
    let mut kept = vec![false; lp.len()];
    for &t in &candidates[..keep] {
        kept[t] = true;
    }
    for (x, kept) in lp.iter_mut().zip(kept) {
        if !kept {
            *x = f32::NEG_INFINITY;
        }
    }
}

/// argmax(logprob / T + Gumbel noise): a draw from softmax(logprob / T). The noise of each
/// token depends only on (seed, step, token).
pub fn gumbel_argmax(logprobs: &[f32], temperature: f32, seed: u64, step: u64) -> u32 {
    let key = step_key(seed, step);
    let t = temperature as f64;
    // Noise is at most -ln(-ln(1 - 2⁻⁵⁴)) < 37.5 (`uniform`'s largest value): a token whose scaled log-probability is that far
    // below the best score so far cannot win, and its noise need not be drawn. Starting from the
    // most likely token skips most of a large vocabulary without changing the draw.
    const MAX_NOISE: f64 = 37.5;
    let first = logprobs.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map_or(0, |(i, _)| i);
    let mut best = (f64::NEG_INFINITY, 0u32);
    for token in std::iter::once(first).chain((0..logprobs.len()).filter(|&i| i != first)) {
        let lp = logprobs[token];
        if lp == f32::NEG_INFINITY || lp as f64 / t + MAX_NOISE < best.0 {
            continue;
        }
        let u = uniform(key, token as u64);
        let score = lp as f64 / t - (-u.ln()).ln();
        // Ties go to the lower token id, as in a pass in token order.
        if score > best.0 || (score == best.0 && token < best.1 as usize) {
            best = (score, token as u32);
        }
    }
    best.1
}

pub use plugin_api::random::{step_key, uniform};

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams { temperature, ..Default::default() }
    }

    /// top-p by a sort of the whole vocabulary, and a Gumbel draw over every token: what the
    /// fast paths must equal.
    fn top_p_by_full_sort(lp: &mut [f32], p: f32) {
        let mut order: Vec<usize> = (0..lp.len()).collect();
        order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]));
        let mut mass = 0.0f64;
        let mut keep = order.len();
        for (i, &t) in order.iter().enumerate() {
            mass += (lp[t] as f64).exp();
            if mass >= p as f64 {
                keep = i + 1;
                break;
            }
        }
        for &t in &order[keep..] {
            lp[t] = f32::NEG_INFINITY;
        }
    }

    fn gumbel_over_every_token(logprobs: &[f32], temperature: f32, seed: u64, step: u64) -> u32 {
        let key = step_key(seed, step);
        let mut best = (f64::NEG_INFINITY, 0u32);
        for (token, &lp) in logprobs.iter().enumerate() {
            if lp == f32::NEG_INFINITY {
                continue;
            }
            let score = lp as f64 / temperature as f64 - (-uniform(key, token as u64).ln()).ln();
            if score > best.0 {
                best = (score, token as u32);
            }
        }
        best.1
    }

    #[test]
    fn the_fast_top_p_and_draw_equal_a_full_sort_and_a_full_draw() {
        for case in 0..200u64 {
            let vocab = 50 + (case as usize * 37) % 3000;
            // Peaked, flat and tied logits.
            let spread = [0.5f32, 3.0, 12.0][case as usize % 3];
            let logits: Vec<f32> =
                (0..vocab).map(|i| ((uniform(case, i as u64) * 8.0).floor() as f32 - 4.0) * spread / 4.0).collect();
            let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let log_sum = logits.iter().map(|&x| ((x - max) as f64).exp()).sum::<f64>().ln() as f32 + max;
            let lp: Vec<f32> = logits.iter().map(|&x| x - log_sum).collect();
            for p in [0.3f32, 0.9, 0.95, 0.999] {
                let (mut fast, mut full) = (lp.clone(), lp.clone());
                top_p(&mut fast, p);
                top_p_by_full_sort(&mut full, p);
                assert_eq!(fast, full, "case {case}, top_p {p}");
                for t in [0.3f32, 0.7, 1.5] {
                    assert_eq!(gumbel_argmax(&fast, t, case, 7), gumbel_over_every_token(&full, t, case, 7));
                    assert_eq!(gumbel_argmax(&lp, t, case, 9), gumbel_over_every_token(&lp, t, case, 9));
                }
            }
        }
    }

    #[test]
    fn greedy_takes_the_argmax() {
        let logits = Array::from_slice(&[0.1f32, 2.0, -1.0, 1.9], &[4]);
        assert_eq!(sample(&logits, &params(0.0), 0).unwrap(), 1);
    }

    #[test]
    fn the_same_seed_and_step_draw_the_same_token() {
        let logits = Array::from_slice(&[0.0f32; 50], &[50]);
        let p = SamplingParams { seed: 9, ..params(1.0) };
        let first: Vec<u32> = (0..20).map(|s| sample(&logits, &p, s).unwrap()).collect();
        let again: Vec<u32> = (0..20).map(|s| sample(&logits, &p, s).unwrap()).collect();
        assert_eq!(first, again);
        assert!(first.iter().any(|&t| t != first[0]), "steps must draw differently: {first:?}");
        let other_seed: Vec<u32> =
            (0..20).map(|s| sample(&logits, &SamplingParams { seed: 10, ..p }, s).unwrap()).collect();
        assert_ne!(first, other_seed);
    }

    #[test]
    fn draws_follow_the_softmax() {
        // Chi-square goodness of fit over 20000 draws, 3 degrees of freedom: the 0.1% critical
        // value is 16.27.
        let logits = [1.0f32, 0.0, -1.0, 0.5];
        let max = 1.0f64;
        let weights: Vec<f64> = logits.iter().map(|&x| (x as f64 - max).exp()).collect();
        let total: f64 = weights.iter().sum();
        let n = 20_000u64;
        let mut counts = [0u64; 4];
        for step in 0..n {
            counts[gumbel_argmax(&filtered_logprobs(&logits, &params(1.0)), 1.0, 3, step) as usize] += 1;
        }
        let chi2: f64 = counts
            .iter()
            .zip(&weights)
            .map(|(&c, w)| {
                let expected = n as f64 * w / total;
                (c as f64 - expected).powi(2) / expected
            })
            .sum();
        assert!(chi2 < 16.27, "chi2 = {chi2}, counts {counts:?}");
    }

    #[test]
    fn filters_remove_what_they_should() {
        let logits = [3.0f32, 2.0, 1.0, 0.0, -5.0];
        let kept = |p: SamplingParams| -> Vec<usize> {
            filtered_logprobs(&logits, &p).iter().enumerate().filter(|(_, x)| x.is_finite()).map(|(i, _)| i).collect()
        };
        assert_eq!(kept(SamplingParams { top_k: 2, ..params(1.0) }), [0, 1]);
        assert_eq!(kept(SamplingParams { top_p: 0.7, ..params(1.0) }), [0, 1]);
        assert_eq!(kept(SamplingParams { min_p: 0.3, ..params(1.0) }), [0, 1]);
        assert_eq!(kept(params(1.0)), [0, 1, 2, 3, 4]);
    }
}

//! The log-probabilities reported with each token: the distribution the token was chosen from,
//! the target's at that position after the request's penalties, and when sampling its filters
//! and temperature (greedy decoding, which neither filters nor scales, reports the whole
//! distribution at temperature 1). A verify window computes them from the same logits plain
//! decoding has at that position, so they are plain decoding's.

use serde::{Deserialize, Serialize};

use super::{filtered_logprobs, SamplingParams};

/// The most alternatives a request may ask for, as OpenAI allows.
pub const MOST_TOP_LOGPROBS: usize = 20;

/// A token, its log-probability, and the `top` most likely tokens with theirs (most likely
/// first, ties by id).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// `token`'s log-probability under `logits` [V] (penalties already applied), filtered and at
/// `params`' temperature when sampling, with the `top` most likely tokens.
pub fn token_logprob(logits: &[f32], params: &SamplingParams, token: u32, top: usize) -> TokenLogprob {
    let unfiltered = SamplingParams::default();
    let mut lp = filtered_logprobs(logits, if params.is_greedy() { &unfiltered } else { params });
    if !params.is_greedy() && params.temperature != 1.0 {
        // log softmax(lp / T), in double precision over the tokens the filters kept.
        let t = params.temperature as f64;
        let max = lp.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64 / t;
        let sum: f64 = lp.iter().filter(|x| x.is_finite()).map(|&x| (x as f64 / t - max).exp()).sum();
        let log_sum = sum.ln() + max;
        lp.iter_mut().filter(|x| x.is_finite()).for_each(|x| *x = (*x as f64 / t - log_sum) as f32);
    }
    let mut order: Vec<u32> = (0..lp.len() as u32).filter(|&t| lp[t as usize].is_finite()).collect();
    let top = top.min(order.len());
    if top > 0 {
        let by_logprob = |a: &u32, b: &u32| lp[*b as usize].total_cmp(&lp[*a as usize]).then(a.cmp(b));
        order.select_nth_unstable_by(top - 1, by_logprob);
        order.truncate(top);
        order.sort_unstable_by(by_logprob);
    }
    TokenLogprob {
        token,
        logprob: lp.get(token as usize).copied().unwrap_or(f32::NEG_INFINITY),
        top: order.iter().take(top).map(|&t| (t, lp[t as usize])).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_distribution_is_the_filtered_one_at_the_temperature() {
        let logits = [2.0f32, 1.0, 0.0, -1.0];
        let greedy = SamplingParams::default();
        let l = token_logprob(&logits, &greedy, 1, 2);
        let z: f64 = logits.iter().map(|&x| (x as f64).exp()).sum();
        assert!((l.logprob as f64 - (1.0 - z.ln())).abs() < 1e-5, "{l:?}");
        assert_eq!(l.top.iter().map(|&(t, _)| t).collect::<Vec<_>>(), [0, 1]);
        // Top-k 2 at temperature 0.5: only tokens 0 and 1, with probabilities ∝ e^(2x).
        let params = SamplingParams { temperature: 0.5, top_k: 2, ..SamplingParams::default() };
        let l = token_logprob(&logits, &params, 1, 4);
        let expected = (2.0f64 - (4.0f64.exp() + 2.0f64.exp()).ln()) as f32;
        assert!((l.logprob - expected).abs() < 1e-5, "{l:?}");
        assert_eq!(l.top.len(), 2, "removed tokens are no alternatives");
        assert_eq!(token_logprob(&logits, &params, 3, 0).logprob, f32::NEG_INFINITY);
    }
}

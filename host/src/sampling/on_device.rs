//! The sampled draw as MLX ops, for logits that live on a device other than the CPU (a GPU):
//! there, reading a 262,144-token row back to the host for every token would cost more than
//! the draw. On the CPU the host's loops ([`super::draw`]) are faster than MLX's ops, and serve.
//!
//! The filters are the host's, in the host's order (top-p, then min-p, then top-k, on the
//! log-probabilities), with one difference: tokens tied at a filter's edge are all kept. The
//! noise of output position `step` is MLX's Gumbel noise under the key `step_key(seed, step)`,
//! the host's key, so that plain decoding and a verify pass draw the same token at the same
//! position. It is MLX's noise, not the host's hash: for one seed a device draws other tokens
//! than the CPU does, from the same distribution.

use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::{argmax_axis, IndexOp};
use mlx_rs::{Array, Dtype};

use super::{all_finite, step_key, Drawn, SampleError, SamplingParams};

/// The token drawn at output position `step` from one position's logits (any shape of V
/// values), at the request's temperature and through its filters, read back.
pub fn draw(logits: &Array, params: &SamplingParams, step: u64) -> Result<u32, SampleError> {
    drawn(logits, params, step)?.read()
}

/// [`draw`]'s token left on the device, with the check that the logits are finite; greedy, MLX's
/// argmax.
pub fn drawn(logits: &Array, params: &SamplingParams, step: u64) -> Result<Drawn, Exception> {
    let row = logits.reshape(&[-1])?;
    let token = match params.is_greedy() {
        true => argmax_axis(&row, 0, None)?.as_dtype(Dtype::Uint32)?,
        false => token(&row, params, step)?,
    };
    Ok(Drawn::OnDevice { token, finite: all_finite(&row)? })
}

/// The sampled tokens [W] (uint32) of a verify window's logits [W, V] whose first position is
/// output step `first_step`, left lazy: position i is drawn as [`draw`] draws step `first_step + i`.
pub fn window_tokens(logits: &Array, params: &SamplingParams, first_step: u64) -> Result<Array, Exception> {
    let positions = (0..logits.shape()[0])
        .map(|i| token(&logits.index(i), params, first_step + i as u64))
        .collect::<Result<Vec<_>, _>>()?;
    mlx_rs::ops::stack(&positions, 0)
}

/// The sampled token (a uint32 scalar) from logits [V], left lazy.
fn token(logits: &Array, params: &SamplingParams, step: u64) -> Result<Array, Exception> {
    let logits = logits.as_dtype(Dtype::Float32)?;
    let vocab = logits.shape()[0];
    // Unfiltered, normalizing would move every token's score alike (as on the host).
    let scores = match params.filters(vocab as usize) {
        true => filtered_logprobs(&logits, params)?,
        false => logits.clone(),
    };
    let key = mlx_rs::random::key(step_key(params.seed, step))?;
    let noise = mlx_rs::random::gumbel::<f32>(&[vocab][..], &key)?;
    let score = scores.divide(Array::from_f32(params.temperature))?.add(&noise)?;
    argmax_axis(&score, 0, None)?.as_dtype(Dtype::Uint32)
}

/// Log-probabilities [V] with the filters applied, removed tokens at -inf.
pub fn filtered_logprobs(logits: &Array, params: &SamplingParams) -> Result<Array, Exception> {
    let vocab = logits.shape()[0];
    let mut lp = logits.subtract(logits.logsumexp(None)?)?;
    if params.top_p > 0.0 && params.top_p < 1.0 {
        // The nucleus: most likely first, a token is in it while the mass before it is below p.
        let descending = mlx_rs::ops::sort_axis(lp.negative()?, 0)?.negative()?;
        let mass_before = descending.exp()?.cumsum(0, None, false)?;
        let inside = mass_before.lt(Array::from_f32(params.top_p))?.as_dtype(Dtype::Int32)?.sum(None)?;
        let least = descending.take_axis(inside.subtract(Array::from_int(1))?.reshape(&[1])?, 0)?;
        lp = kept_from(&lp, &least)?;
    }
    if params.min_p > 0.0 {
        let least = lp.max(None)?.add(Array::from_f32(params.min_p.ln()))?;
        lp = kept_from(&lp, &least)?;
    }
    let k = params.top_k as i32;
    if k > 0 && k < vocab {
        // The k-th largest: the (V - k)-th smallest, in place after a partition.
        let least = mlx_rs::ops::partition_axis(&lp, vocab - k, 0)?.index(vocab - k);
        lp = kept_from(&lp, &least)?;
    }
    Ok(lp)
}

/// `lp` with every value below `least` set to -inf.
fn kept_from(lp: &Array, least: &Array) -> Result<Array, Exception> {
    mlx_rs::ops::select(&lp.ge(least)?, lp, Array::from_f32(f32::NEG_INFINITY))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32) -> SamplingParams {
        SamplingParams { temperature, ..Default::default() }
    }

    fn kept(logits: &[f32], params: &SamplingParams) -> Vec<usize> {
        let lp = filtered_logprobs(&Array::from_slice(logits, &[logits.len() as i32]), params).unwrap();
        lp.as_slice::<f32>().iter().enumerate().filter(|(_, x)| x.is_finite()).map(|(i, _)| i).collect()
    }

    /// Logits with no two alike, so that no filter's edge falls on a tie.
    fn distinct_logits(n: usize, seed: u64) -> Vec<f32> {
        (0..n).map(|i| (super::super::uniform(seed, i as u64) as f32 - 0.5) * 8.0).collect()
    }

    #[test]
    fn filters_keep_the_tokens_the_host_keeps() {
        let settings = [
            SamplingParams { top_p: 0.9, ..params(0.7) },
            SamplingParams { top_p: 0.3, ..params(0.7) },
            SamplingParams { min_p: 0.05, ..params(0.7) },
            SamplingParams { top_k: 5, ..params(0.7) },
            SamplingParams { top_k: 1, ..params(0.7) },
            SamplingParams { top_p: 0.95, min_p: 0.01, top_k: 20, ..params(0.7) },
        ];
        for seed in 0..5 {
            let logits = distinct_logits(300, seed);
            for p in &settings {
                let host: Vec<usize> = super::super::filtered_logprobs(&logits, p)
                    .iter()
                    .enumerate()
                    .filter(|(_, x)| x.is_finite())
                    .map(|(i, _)| i)
                    .collect();
                assert_eq!(kept(&logits, p), host, "{p:?}, logits {seed}");
            }
        }
    }

    #[test]
    fn a_draw_depends_on_seed_and_step_alone() {
        let logits = distinct_logits(64, 1);
        let window = Array::from_slice(&[logits.clone(), logits.clone()].concat(), &[2, 64]);
        let p = SamplingParams { top_p: 0.9, seed: 11, ..params(1.0) };
        for step in 0..20 {
            let alone = draw(&Array::from_slice(&logits, &[64]), &p, step).unwrap();
            // The same logits as a row of a verify window draw the same token at the same step.
            assert_eq!(draw(&window.index(1), &p, step).unwrap(), alone);
        }
        let tokens: Vec<u32> = (0..20).map(|s| draw(&Array::from_slice(&logits, &[64]), &p, s).unwrap()).collect();
        assert!(tokens.windows(2).any(|w| w[0] != w[1]), "every step drew {}", tokens[0]);
    }

    #[test]
    fn draws_follow_the_tempered_distribution() {
        let logits = [2.0f32, 1.0, 0.5, -1.0];
        let t = 0.8;
        let weights: Vec<f64> = logits.iter().map(|&x| (x as f64 / t as f64).exp()).collect();
        let total: f64 = weights.iter().sum();
        let n = 4000;
        let mut counts = [0usize; 4];
        for step in 0..n {
            counts[draw(&Array::from_slice(&logits, &[4]), &params(t), step as u64).unwrap() as usize] += 1;
        }
        for (token, (&c, &w)) in counts.iter().zip(&weights).enumerate() {
            let expected = n as f64 * w / total;
            // Five standard deviations of a binomial count.
            let sd = (expected * (1.0 - w / total)).sqrt();
            assert!((c as f64 - expected).abs() < 5.0 * sd, "token {token}: {c} draws, expected {expected:.0}");
        }
    }

    #[test]
    fn filtered_tokens_are_never_drawn_and_non_finite_logits_are_refused() {
        let logits = distinct_logits(50, 2);
        let p = SamplingParams { top_k: 3, ..params(2.0) };
        let allowed = kept(&logits, &p);
        assert_eq!(allowed.len(), 3);
        for step in 0..200 {
            let t = draw(&Array::from_slice(&logits, &[50]), &p, step).unwrap() as usize;
            assert!(allowed.contains(&t), "step {step} drew {t}, outside the top 3 {allowed:?}");
        }
        let mut bad = logits.clone();
        bad[7] = f32::NAN;
        assert!(matches!(draw(&Array::from_slice(&bad, &[50]), &p, 0), Err(SampleError::NonFinite)));
    }
}

//! The draw itself: argmax(logprob / T + Gumbel noise), a draw from softmax(logprob / T). The
//! noise of each token depends only on (seed, step, token); ties go to the lower token id.
//!
//! Two logarithms per token of a real vocabulary would cost a sizeable part of a decode step, so
//! a token's noise is computed only where it could win. Against the best score so far, a token
//! at most `b` nats (scaled) below the top can only win with noise above a bound, that is with a
//! uniform above `exp(-exp(-bound))`. The tokens within a nat of the top are scored first; then
//! one pass over the vocabulary, 64 tokens at a time, compares each token's uniform (one hash,
//! eight tokens to a vector) with the bound of its chunk's most likely token, and scores only
//! the few above it. The noise never exceeds -ln(-ln(1 - 2⁻⁵⁴)) < 37.5 (`uniform`'s largest
//! value), so a chunk lying further below the best score needs no hash at all. The result is
//! the argmax over every token.

use kernels::scan::{chunk_maxima, flags_where, set_flags, CHUNK};
use plugin_api::random::{step_key, uniform, uniform_bits};

/// The noise's largest value is below this.
const MAX_NOISE: f64 = 37.5;
/// Bins of tokens 0, 1, 2, … nats (scaled) below the top. The noise's least value
/// (-ln(-ln(2⁻⁵⁴)) > -3.7) puts the best score above top - 3.7, so a token `REACH` or more nats
/// below the top cannot win.
const REACH: usize = (MAX_NOISE + 3.7) as usize + 1;
/// Bounds are lowered by this much, far above the rounding of the scores, so that a token passed
/// over scores strictly below the best.
const SLACK: f64 = 1e-6;

/// The token drawn at output position `step` under `seed` from `logprobs` (or logits: any
/// constant offset draws the same token) at `temperature`; -inf marks a removed token.
pub fn gumbel_argmax(logprobs: &[f32], temperature: f32, seed: u64, step: u64) -> u32 {
    let key = step_key(seed, step);
    // Each half's best, then the better of the two (ties to the lower token, the first half's).
    let (lower, upper) = super::on_halves(logprobs, |half, offset| best_draw(half, offset as u64, temperature, key));
    match (lower, upper) {
        (Some(a), Some(b)) if b.0 > a.0 => b.1,
        (Some(a), _) => a.1,
        (None, Some(b)) => b.1,
        (None, None) => 0,
    }
}

/// The best score and its token among `logprobs` (token ids from `offset`), if any is finite.
fn best_draw(logprobs: &[f32], offset: u64, temperature: f32, key: u64) -> Option<(f64, u32)> {
    let maxima = chunk_maxima(logprobs);
    let top_lp = maxima.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if top_lp == f32::NEG_INFINITY {
        return None;
    }
    let mut draw = Draw::new(top_lp, temperature, key);
    // The tokens within a nat (scaled) of the top first, so that the pass starts against a best
    // score near the final one and scores few tokens.
    let near = top_lp - temperature;
    for (c, chunk) in logprobs.chunks(CHUNK).enumerate().filter(|&(c, _)| maxima[c] >= near) {
        for (j, &lp) in chunk.iter().enumerate().filter(|&(_, &lp)| lp >= near) {
            draw.consider(offset + (c * CHUNK + j) as u64, lp);
        }
    }
    draw.set_bounds();
    let mut flags = [0u8; CHUNK];
    for (c, chunk) in logprobs.chunks(CHUNK).enumerate() {
        let least = draw.least_bits_below(maxima[c]);
        if least == u64::MAX {
            continue;
        }
        let first = offset + (c * CHUNK) as u64;
        reaching(key, first, least, &mut flags[..chunk.len()]);
        for j in set_flags(&flags[..chunk.len()]) {
            if draw.consider(first + j as u64, chunk[j]) {
                draw.set_bounds();
            }
        }
    }
    Some(draw.best)
}

/// The best (score, token) so far, and per bin the least uniform bits that could beat it.
struct Draw {
    best: (f64, u32),
    top: f64,
    temperature: f64,
    key: u64,
    least_bits: [u64; REACH],
}

impl Draw {
    fn new(top_lp: f32, temperature: f32, key: u64) -> Draw {
        let temperature = temperature as f64;
        let top = top_lp as f64 / temperature;
        Draw { best: (f64::NEG_INFINITY, 0), top, temperature, key, least_bits: [0; REACH] }
    }

    fn scaled(&self, lp: f32) -> f64 {
        lp as f64 / self.temperature
    }

    /// Scores `token` exactly; whether it became the best.
    fn consider(&mut self, token: u64, lp: f32) -> bool {
        if lp == f32::NEG_INFINITY {
            return false;
        }
        let token = token as u32;
        let u = uniform(self.key, token as u64);
        let score = self.scaled(lp) - (-u.ln()).ln();
        let better = score > self.best.0 || (score == self.best.0 && token < self.best.1);
        if better {
            self.best = (score, token);
        }
        better
    }

    /// Each bin's bound against the best score so far, as `uniform_bits`: a token of the bin
    /// whose bits lie below it cannot win.
    fn set_bounds(&mut self) {
        for (b, least) in self.least_bits.iter_mut().enumerate() {
            // The bin's tokens score at most `highest` before noise.
            let highest = self.top - b as f64;
            let needed = self.best.0 - highest - SLACK;
            *least = if needed > MAX_NOISE {
                u64::MAX
            } else if needed == f64::NEG_INFINITY {
                0
            } else {
                // The uniform giving noise `needed` is lowered by far more than the two
                // exponentials' rounding (relative 1e-14 against at most e^3.7 ulps), and its
                // bits are rounded down, then one less: a uniform whose bits lie below is one
                // whose noise is below `needed`.
                let least_uniform = (-(-needed).exp()).exp() * (1.0 - 1e-14);
                ((least_uniform * (1u64 << 53) as f64).floor() as u64).saturating_sub(1)
            };
        }
    }

    /// The bound for tokens scoring at most `lp` (scaled): that of the bin `lp` falls in.
    fn least_bits_below(&self, lp: f32) -> u64 {
        if lp == f32::NEG_INFINITY {
            return u64::MAX;
        }
        // Rounding may put `lp` a bin too deep (by 1e-14): SLACK in the bounds covers it.
        let below = self.top - self.scaled(lp);
        self.least_bits.get(below as usize).copied().unwrap_or(u64::MAX)
    }
}

/// Sets `flags[j]` to 1 where token `first + j`'s uniform bits reach `least`, else to 0.
fn reaching(key: u64, first: u64, least: u64, flags: &mut [u8]) {
    flags_where(first, flags, move |token| uniform_bits(key, token) >= least);
}

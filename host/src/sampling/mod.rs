//! Choosing a token from logits, as mlx-lm's `make_sampler` does: greedy at temperature 0,
//! otherwise top-p, then min-p, then top-k on the log-probabilities, then a draw at the
//! temperature. Every draw uses a key derived from (seed, step) alone, where step is the index
//! of the output token: any path to the same output position (plain decoding, or the verify
//! pass of speculative decoding) draws with the same noise and so picks the same token.

use filters::{top_k, top_p};
use kernels::argmax::first_max_half;
use kernels::scan::exp_sum;
use mlx_rs::error::Exception;
use mlx_rs::Array;

mod filters;
mod gumbel;
mod logprobs;
pub mod on_device;
mod penalties;

pub use gumbel::gumbel_argmax;
pub use logprobs::{token_logprob, TokenLogprob, MOST_TOP_LOGPROBS};
pub use penalties::{Penalties, REPETITION_CONTEXT};

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

    /// Whether top-p, min-p or top-k removes any token of a `vocab`-token distribution.
    pub fn filters(&self, vocab: usize) -> bool {
        (self.top_p > 0.0 && self.top_p < 1.0) || self.min_p > 0.0 || (self.top_k > 0 && (self.top_k as usize) < vocab)
    }

    /// One line naming the first parameter out of range, if any.
    pub fn validate(&self) -> Result<(), String> {
        check_temperature(self.temperature)?;
        check_top_p(self.top_p)?;
        check_min_p(self.min_p)
    }
}

/// The bounds of each sampling parameter, the same wherever it is set (flags, manifests,
/// `generation_config.json`, requests).
pub fn check_temperature(temperature: f32) -> Result<(), String> {
    if temperature >= 0.0 && temperature.is_finite() {
        Ok(())
    } else {
        Err(format!("temperature must be a finite number >= 0, got {temperature}"))
    }
}

pub fn check_top_p(top_p: f32) -> Result<(), String> {
    if top_p > 0.0 && top_p <= 1.0 {
        Ok(())
    } else {
        Err(format!("top_p must be in (0, 1] (1 = off), got {top_p}"))
    }
}

pub fn check_min_p(min_p: f32) -> Result<(), String> {
    if (0.0..=1.0).contains(&min_p) {
        Ok(())
    } else {
        Err(format!("min_p must be in [0, 1], got {min_p}"))
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

/// Whether every one of `logits` is finite, as one reduction on the device (evaluated with the
/// token it guards, so the check costs no round trip of its own).
fn all_finite(logits: &Array) -> Result<Array, Exception> {
    logits.is_finite()?.all(None)
}

fn check_finite(logits: &[f32]) -> Result<(), SampleError> {
    if logits.iter().all(|x| x.is_finite()) {
        Ok(())
    } else {
        Err(SampleError::NonFinite)
    }
}

/// The token for output position `step`, from that position's logits [V] (or [1, .., V]), read.
pub fn sample(logits: &Array, params: &SamplingParams, step: u64) -> Result<u32, SampleError> {
    draw_token(logits, params, step)?.read()
}

/// A token drawn from one position's logits: read already, where the host's loops draw it (MLX
/// on the CPU), or still being computed on the device, where the next step can take it as its
/// input before the host reads it (what keeps a GPU busy between steps, as mlx-lm does).
pub enum Drawn {
    Read(u32),
    /// The token (a uint32 scalar) and whether the logits were all finite, both lazy.
    OnDevice {
        token: Array,
        finite: Array,
    },
}

impl Drawn {
    /// Starts computing the token, without waiting for it.
    pub fn queue(&self) -> Result<(), Exception> {
        match self {
            Drawn::Read(_) => Ok(()),
            Drawn::OnDevice { token, finite } => mlx_rs::transforms::async_eval([token, finite]),
        }
    }

    /// Whether the token is still on the device.
    pub fn on_device(&self) -> bool {
        matches!(self, Drawn::OnDevice { .. })
    }

    /// The token as the model's input ids [1, 1] int32, lazily where it is on the device.
    pub fn ids(&self) -> Result<Array, Exception> {
        match self {
            Drawn::Read(token) => Ok(crate::generate::token_ids(&[*token])),
            Drawn::OnDevice { token, .. } => token.as_dtype(mlx_rs::Dtype::Int32)?.reshape(&[1, 1]),
        }
    }

    /// The token on the host: the one read-back of a step on a device.
    pub fn read(&self) -> Result<u32, SampleError> {
        match self {
            Drawn::Read(token) => Ok(*token),
            Drawn::OnDevice { token, finite } => {
                plugin_api::nn::sync::eval([token, finite])?;
                match finite.item_exact::<bool>() {
                    true => Ok(token.item_exact::<u32>()),
                    false => Err(SampleError::NonFinite),
                }
            }
        }
    }
}

/// The token for output position `step` from that position's logits, drawn by the host's loops
/// where MLX computes on the CPU (read at once) and by MLX's ops elsewhere (left on the device).
pub fn draw_token(logits: &Array, params: &SamplingParams, step: u64) -> Result<Drawn, SampleError> {
    if kernels::route::on_cpu() {
        return host_token(logits, params, step).map(Drawn::Read);
    }
    Ok(on_device::drawn(logits, params, step)?)
}

/// [`draw_token`] by the host's loops, over logits in host memory.
fn host_token(logits: &Array, params: &SamplingParams, step: u64) -> Result<u32, SampleError> {
    let logits = kernels::row_major(logits)?;
    if params.is_greedy() {
        // A scan of the logits costs less than MLX's argmax, its conversion and their round trip.
        if let Some(bits) = kernels::bits16(&logits) {
            return first_max_half(bits, logits.dtype()).ok_or(SampleError::NonFinite);
        }
        return kernels::with_floats(&logits, |row| {
            check_finite(row)?;
            Ok(kernels::argmax::first_max(row))
        })?;
    }
    kernels::with_floats(&logits, |row| {
        check_finite(row)?;
        Ok(draw(row, params, step))
    })?
}

/// The token for output position `step` from logits [V] (or [1, .., V]) after `prefix` (moved
/// by its penalties), with its log-probabilities where asked for; chosen on the host on every
/// route.
pub fn token_after(
    logits: &Array,
    params: &SamplingParams,
    prefix: &Prefix,
    step: u64,
) -> Result<(u32, Option<TokenLogprob>), SampleError> {
    // Widened on the host, as a window's logits are (an MLX conversion costs a round trip).
    let logits = kernels::row_major(logits)?;
    kernels::with_floats(&logits, |row| {
        check_finite(row)?;
        Ok(choose_after(row, params, prefix, step))
    })?
}

/// What a position's token is chosen with besides its logits, where the host chooses it: the
/// tokens before it, the request's penalties, and how many alternatives to report with it.
pub struct Prefix<'a> {
    pub prompt: &'a [u32],
    pub generated: &'a [u32],
    pub penalties: &'a Penalties,
    /// Report the token's log-probability with this many alternatives.
    pub logprobs: Option<usize>,
}

impl Prefix<'_> {
    /// Whether the host must choose the token from the logits.
    pub fn on_host(&self) -> bool {
        self.penalties.any() || self.logprobs.is_some()
    }

    /// `logits` moved by the penalties for the tokens before.
    fn moved<'l>(&self, logits: &'l [f32]) -> std::borrow::Cow<'l, [f32]> {
        if !self.penalties.any() {
            return logits.into();
        }
        let mut moved = logits.to_vec();
        self.penalties.apply(&mut moved, self.prompt, self.generated);
        moved.into()
    }
}

/// The token chosen from `logits` after `prefix`, and its log-probabilities where asked for.
fn choose_after(logits: &[f32], params: &SamplingParams, prefix: &Prefix, step: u64) -> (u32, Option<TokenLogprob>) {
    let moved = prefix.moved(logits);
    let token = match params.is_greedy() {
        true => kernels::argmax::first_max(&moved),
        false => draw(&moved, params, step),
    };
    (token, prefix.logprobs.map(|top| token_logprob(&moved, params, token, top)))
}

/// What the accept step needs of one row of a verify window.
pub struct WindowRow<'a> {
    pub params: &'a SamplingParams,
    /// Whether the row's logits are moved by penalties or its log-probabilities reported: its
    /// tokens are then chosen on the host, position by position, from its logits.
    pub on_host: bool,
    /// The output step of the window's first position.
    pub first_step: u64,
    /// Whether the accept step reads each position's distribution (rejection sampling).
    pub distributions: bool,
}

/// The target's side of one row of a verify window [W, V]: each position's token, where it was
/// chosen with the window (greedy anywhere; sampled off the CPU), and the logits on the host,
/// where the host draws a position when asked (sampled on the CPU) or the accept step reads its
/// distribution. Position i is output step `first_step + i`; its token is what [`sample`] would
/// give there.
pub struct WindowTokens {
    chosen: Option<Vec<u32>>,
    logits: Option<Vec<f32>>,
    vocab: usize,
    first_step: u64,
}

impl WindowTokens {
    /// One window's logits [W, V] from output step 0 (the accept step's tests; rounds use
    /// [`Self::rows`]).
    #[cfg(test)]
    pub fn new(logits: &Array, params: &SamplingParams) -> Result<WindowTokens, SampleError> {
        let shape = logits.shape();
        let row = WindowRow { params, on_host: false, first_step: 0, distributions: !params.is_greedy() };
        let rows = WindowTokens::rows(&logits.reshape(&[1, shape[0], shape[1]])?, &[row], &[])?;
        Ok(rows.into_iter().next().expect("one row"))
    }

    /// Each row's window from logits [B, W, V]. Where MLX runs on the CPU, every row's logits
    /// are read on the host once: greedy rows scan them there, sampled rows copy theirs.
    /// Elsewhere every token of the window is chosen by MLX ops and read back in one wait, with
    /// the logits of rows whose distributions are read, and with `also` (a round's drafts left
    /// on the device): on a GPU each wait is a round trip.
    pub fn rows(logits: &Array, rows: &[WindowRow], also: &[Array]) -> Result<Vec<WindowTokens>, SampleError> {
        let (width, vocab) = (logits.shape()[1] as usize, logits.shape()[2] as usize);
        let window = |b: usize, chosen: Option<Vec<u32>>, logits: Option<Vec<f32>>| WindowTokens {
            chosen,
            logits,
            vocab,
            first_step: rows[b].first_step,
        };
        if kernels::route::on_cpu() {
            let span = |b: usize| b * width * vocab..(b + 1) * width * vocab;
            let sampled = rows.iter().any(|r| !r.params.is_greedy() || r.on_host);
            // Widened on the host rather than by an MLX conversion, whose round trip is a large
            // share of sampling a small vocabulary.
            let logits = kernels::row_major(logits)?;
            if let (false, Some(bits)) = (sampled, kernels::bits16(&logits)) {
                let greedy = |b: usize| -> Result<WindowTokens, SampleError> {
                    let best = bits[span(b)].chunks(vocab).map(|row| first_max_half(row, logits.dtype()));
                    Ok(window(b, Some(best.collect::<Option<_>>().ok_or(SampleError::NonFinite)?), None))
                };
                return (0..rows.len()).map(greedy).collect();
            }
            return kernels::with_floats(&logits, |all| {
                check_finite(all)?;
                let one = |b: usize| {
                    let logits = &all[span(b)];
                    match rows[b].params.is_greedy() && !rows[b].on_host {
                        true => window(b, Some(logits.chunks(vocab).map(kernels::argmax::first_max).collect()), None),
                        false => window(b, None, Some(logits.to_vec())),
                    }
                };
                Ok((0..rows.len()).map(one).collect())
            })?;
        }
        let best = mlx_rs::ops::indexing::argmax_axis(logits, -1, None)?.as_dtype(mlx_rs::Dtype::Uint32)?;
        let finite = all_finite(logits)?;
        let mut sampled = Vec::new();
        let mut distributions = Vec::new();
        for (b, row) in rows.iter().enumerate() {
            let own = index_0(logits, b)?;
            if !row.params.is_greedy() && !row.on_host {
                sampled.push((b, on_device::window_tokens(&own, row.params, row.first_step)?));
            }
            if row.distributions || row.on_host {
                distributions.push((b, own.as_dtype(mlx_rs::Dtype::Float32)?));
            }
        }
        let read = sampled.iter().chain(&distributions).map(|(_, a)| a).chain(also);
        plugin_api::nn::sync::eval([&best, &finite].into_iter().chain(read))?;
        if !finite.item_exact::<bool>() {
            return Err(SampleError::NonFinite);
        }
        let best = best.as_slice::<u32>();
        let mut out: Vec<WindowTokens> =
            (0..rows.len()).map(|b| window(b, Some(best[b * width..(b + 1) * width].to_vec()), None)).collect();
        for (b, tokens) in sampled {
            out[b].chosen = Some(tokens.as_slice::<u32>().to_vec());
        }
        for (b, logits) in distributions {
            out[b].logits = Some(logits.as_slice::<f32>().to_vec());
            if rows[b].on_host {
                out[b].chosen = None;
            }
        }
        Ok(out)
    }

    /// The logits of position `i` on the host, where the window has them.
    pub fn row(&self, i: usize) -> Option<&[f32]> {
        self.logits.as_ref().map(|l| &l[i * self.vocab..(i + 1) * self.vocab])
    }

    /// Position `i`'s logits moved by the penalties for the tokens before it, where the window
    /// has them.
    pub fn row_after(&self, i: usize, prefix: &Prefix) -> Option<std::borrow::Cow<'_, [f32]>> {
        self.row(i).map(|row| prefix.moved(row))
    }

    /// [`Self::token`] after `prefix`, with its log-probabilities where asked for.
    pub fn token_after(
        &self,
        i: usize,
        params: &SamplingParams,
        step: u64,
        prefix: &Prefix,
    ) -> Result<(u32, Option<TokenLogprob>), SampleError> {
        if !prefix.on_host() {
            return Ok((self.token(i, params, step)?, None));
        }
        let row = self.row(i).expect("a window chosen on the host keeps its logits");
        Ok(choose_after(row, params, prefix, step))
    }

    /// The target's token at position `i`, drawn as output step `step`: `first_step + i` in a
    /// chain's window, the node's depth past `first_step` in a tree's (whose tokens are chosen
    /// with the window only where greedy).
    pub fn token(&self, i: usize, params: &SamplingParams, step: u64) -> Result<u32, SampleError> {
        match &self.chosen {
            Some(tokens) => {
                let drawn_there = params.is_greedy() || step == self.first_step + i as u64;
                debug_assert!(drawn_there, "position {i} of a window from step {}, asked at {step}", self.first_step);
                Ok(tokens[i])
            }
            None => Ok(draw(self.row(i).expect("a window keeps its tokens or its logits"), params, step)),
        }
    }
}

/// Entry `i` of `a`'s first axis.
fn index_0(a: &Array, i: usize) -> Result<Array, Exception> {
    a.take_axis(Array::from_int(i as i32), 0)
}

/// The token drawn at output position `step` from one position's logits, at the request's
/// temperature and through its filters.
pub fn draw(logits: &[f32], params: &SamplingParams, step: u64) -> u32 {
    let (t, seed) = (params.temperature, params.seed);
    if params.top_p > 0.0 && params.top_p < 1.0 {
        // The nucleus is a mass: it needs the probabilities.
        return gumbel_argmax(&filtered_logprobs(logits, params), t, seed, step);
    }
    // Otherwise the log-probabilities are the logits less one constant, which moves every
    // token's score alike and keeps their order and their distances to the best: min-p, top-k
    // and the draw give the same tokens on the logits, without the pass of exponentials over
    // the vocabulary that normalizing takes, a large share of a draw from a large vocabulary.
    if params.filters(logits.len()) {
        let mut scores = logits.to_vec();
        min_p_and_top_k(&mut scores, params);
        return gumbel_argmax(&scores, t, seed, step);
    }
    gumbel_argmax(logits, t, seed, step)
}

/// Log-probabilities with the filters applied (removed tokens at -inf), before temperature.
pub fn filtered_logprobs(logits: &[f32], params: &SamplingParams) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    // Summed in two halves, each in token order, then added: the same sum whether or not the
    // halves run at once.
    let (lower, upper) = on_halves(logits, |half, _| exp_sum(half, max));
    let log_sum = (lower + upper).ln() as f32 + max;
    let mut lp: Vec<f32> = logits.iter().map(|&x| x - log_sum).collect();
    if params.top_p > 0.0 && params.top_p < 1.0 {
        top_p(&mut lp, params.top_p);
    }
    min_p_and_top_k(&mut lp, params);
    lp
}

/// min-p, then top-k, on log-probabilities or on logits (both filters look only at order and
/// at distances to the best).
fn min_p_and_top_k(scores: &mut [f32], params: &SamplingParams) {
    if params.min_p > 0.0 {
        let best = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let threshold = best + params.min_p.ln();
        scores.iter_mut().filter(|x| **x < threshold).for_each(|x| *x = f32::NEG_INFINITY);
    }
    let k = params.top_k as usize;
    if k > 0 && k < scores.len() {
        top_k(scores, k);
    }
}

/// Vocabularies from which [`on_halves`] gives a half to the products' helper thread. Below it a
/// pass takes tens of microseconds (the demo target's 8,192 tokens) and stays on one thread.
const HALVES_IN_PARALLEL: usize = 1 << 15;

/// `f(half, offset)` on the two halves of `values` (offset: the index of a half's first value),
/// the second half on the products' helper thread when `values` is long enough.
fn on_halves<T: Send>(values: &[f32], f: impl Fn(&[f32], usize) -> T + Sync) -> (T, T) {
    let middle = values.len() / 2;
    let (lower, upper) = values.split_at(middle);
    if values.len() < HALVES_IN_PARALLEL {
        return (f(lower, 0), f(upper, middle));
    }
    let (mut first, mut second) = (None, None);
    kernels::helper::join(|| first = Some(f(lower, 0)), || second = Some(f(upper, middle)));
    (first.expect("joined"), second.expect("joined"))
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

    /// The first k tokens of a stable sort, most likely first.
    fn top_k_by_full_sort(lp: &mut [f32], k: usize) {
        let mut order: Vec<usize> = (0..lp.len()).collect();
        order.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]));
        for &t in &order[k..] {
            lp[t] = f32::NEG_INFINITY;
        }
    }

    /// `lp` through top-p, the fast way, checked against the full sort.
    fn top_p_both_ways(lp: &[f32], p: f32, what: &str) -> Vec<f32> {
        let (mut fast, mut full) = (lp.to_vec(), lp.to_vec());
        top_p(&mut fast, p);
        top_p_by_full_sort(&mut full, p);
        assert_eq!(fast, full, "{what}, top_p {p}");
        fast
    }

    /// `lp` through top-k, the fast way, checked against the full sort.
    fn top_k_both_ways(lp: &[f32], k: usize, what: &str) {
        let (mut fast, mut full) = (lp.to_vec(), lp.to_vec());
        top_k(&mut fast, k);
        top_k_by_full_sort(&mut full, k);
        assert_eq!(fast, full, "{what}, top_k {k}");
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
    fn the_fast_filters_and_draw_equal_a_full_sort_and_a_full_draw() {
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
                let nucleus = top_p_both_ways(&lp, p, &format!("case {case}"));
                for k in [1usize, 7, 40] {
                    top_k_both_ways(&lp, k, &format!("case {case}"));
                }
                for t in [0.3f32, 0.7, 1.5] {
                    assert_eq!(gumbel_argmax(&nucleus, t, case, 7), gumbel_over_every_token(&nucleus, t, case, 7));
                    assert_eq!(gumbel_argmax(&lp, t, case, 9), gumbel_over_every_token(&lp, t, case, 9));
                }
            }
        }
    }

    /// Vocabularies of Gemma 4's order of size, split across the helper thread: likely tokens
    /// spread out, all in one place (a sorted vocabulary), a flat distribution (the nucleus is
    /// everything), and runs of removed tokens.
    #[test]
    fn on_large_vocabularies_the_fast_filters_and_draw_equal_a_full_sort_and_a_full_draw() {
        let vocab = 70_001;
        let spread = |i: usize| ((uniform(11, i as u64) - 0.5) * 30.0) as f32;
        let shapes: [(&str, Vec<f32>); 4] = [
            ("spread", (0..vocab).map(spread).collect()),
            ("sorted", (0..vocab).map(|i| 20.0 - i as f32 * 1e-3).collect()),
            ("flat", vec![0.25; vocab]),
            (
                "removed runs",
                (0..vocab).map(|i| if (i / 640) % 3 == 1 { f32::NEG_INFINITY } else { spread(i) }).collect(),
            ),
        ];
        for (shape, logits) in shapes {
            let lp = filtered_logprobs(&logits, &SamplingParams::default());
            for p in [0.5f32, 0.95] {
                top_p_both_ways(&lp, p, shape);
            }
            for k in [1usize, 40, 5000] {
                top_k_both_ways(&lp, k, shape);
            }
            for (t, step) in [(0.3f32, 1u64), (0.7, 2), (1.0, 3), (2.5, 4)] {
                assert_eq!(gumbel_argmax(&lp, t, 5, step), gumbel_over_every_token(&lp, t, 5, step), "{shape}, T {t}");
                let top_p = SamplingParams { temperature: t, top_p: 0.95, seed: 5, ..Default::default() };
                let mut nucleus = lp.clone();
                top_p_by_full_sort(&mut nucleus, 0.95);
                assert_eq!(
                    draw(&logits, &top_p, step),
                    gumbel_over_every_token(&nucleus, t, 5, step),
                    "{shape}, T {t}"
                );
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
    fn without_top_p_a_draw_from_the_logits_is_the_draw_from_the_log_probabilities() {
        let logits: Vec<f32> = (0..4096).map(|i| (uniform(3, i) as f32 - 0.5) * 20.0).collect();
        let settings = [
            SamplingParams::default(),
            SamplingParams { top_k: 40, ..Default::default() },
            SamplingParams { min_p: 0.01, ..Default::default() },
            SamplingParams { min_p: 0.2, top_k: 5, ..Default::default() },
        ];
        for filters in settings {
            for (step, t) in (0..300).zip([0.5f32, 1.0, 1.7].into_iter().cycle()) {
                let p = SamplingParams { temperature: t, seed: 4, ..filters };
                let lp = filtered_logprobs(&logits, &p);
                assert_eq!(draw(&logits, &p, step), gumbel_argmax(&lp, t, 4, step), "{p:?}, step {step}");
            }
        }
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

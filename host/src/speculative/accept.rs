//! The accept step of one row: the target's own token at each position of its window, taking
//! drafts while they agree (match), or by rejection sampling when the drafter gave its
//! probabilities.

use kernels::{row_major, with_floats};

use super::{Row, Verify};
use crate::generate::{Flow, GenerateError, Request, StopReason};
use crate::sampling::{filtered_logprobs, gumbel_argmax, step_key, token_logprob, uniform, TokenLogprob, WindowTokens};
use plugin_api::sdk::Proposal;

/// Walks one row's window (W ≥ drafts + 1 positions), emitting the tokens it keeps and
/// stopping at the first rejected draft, an end-of-sequence token or `max_tokens`. Returns how
/// many drafts were accepted.
pub(super) fn accept(
    row: &mut Row,
    request: &Request,
    proposal: &Proposal,
    window: &WindowTokens,
    verify: Verify,
    mut emit: impl FnMut(u32, Option<TokenLogprob>) -> Flow,
) -> Result<usize, GenerateError> {
    let drafts = &proposal.tokens;
    let step = row.tokens.len() as u64;
    let verify = if request.sampling.is_greedy() { Verify::Match } else { verify };
    row.stats.rounds += 1;
    row.stats.target_forwards += 1;
    row.stats.drafted += drafts.len();
    for d in row.by_position.iter_mut().take(drafts.len()) {
        d.0 += 1;
    }
    // The drafter's distributions [drafts, V], read once.
    let q = match (verify, &proposal.probabilities) {
        (Verify::Rejection, Some(q)) => Some(with_floats(&row_major(q)?, <[f32]>::to_vec)?),
        _ => None,
    };
    let mut accepted = 0;
    for i in 0..=drafts.len() {
        let draft = drafts.get(i).copied();
        // Position i extends the prompt and the tokens kept so far, this window's included.
        let prefix = request.prefix(&row.tokens);
        let rejecting = match (verify, draft, &q) {
            (Verify::Rejection, Some(d), Some(q)) => window.row_after(i, &prefix).map(|target| (d, q, target)),
            _ => None,
        };
        let (token, took_draft, logprob) = match rejecting {
            Some((d, q, target)) => {
                let v = target.len();
                let (t, took) = rejection_step(&target, &q[i * v..(i + 1) * v], d, request, step + i as u64)?;
                (t, took, prefix.logprobs.map(|top| token_logprob(&target, &request.sampling, t, top)))
            }
            None => {
                let (t, logprob) = window
                    .token_after(i, &request.sampling, step + i as u64, &prefix)
                    .map_err(|e| GenerateError::sampling_at(step as usize + i, e))?;
                (t, draft == Some(t), logprob)
            }
        };
        if took_draft {
            accepted += 1;
            row.by_position[i].1 += 1;
            row.stats.accepted += 1;
        }
        if !keep(row, request, token, logprob, &mut emit) || !took_draft {
            break;
        }
    }
    if let Some(&last) = row.tokens.last() {
        row.pending = last;
    }
    row.acceptance.record(drafts.len(), accepted);
    Ok(accepted)
}

/// Emits `token`, the row's next, unless it ends the sequence; whether the row goes on (no
/// end-of-sequence token, `max_tokens` not reached, no stop asked for), its stop reason if not.
pub(super) fn keep(
    row: &mut Row,
    request: &Request,
    token: u32,
    logprob: Option<TokenLogprob>,
    emit: &mut impl FnMut(u32, Option<TokenLogprob>) -> Flow,
) -> bool {
    if request.eos.contains(&token) {
        row.stop = Some(StopReason::Eos);
        return false;
    }
    row.tokens.push(token);
    row.logprobs.extend(logprob.clone());
    let flow = emit(token, logprob);
    if row.tokens.len() == request.max_tokens {
        row.stop = Some(StopReason::MaxTokens);
        return false;
    }
    if flow == Flow::Stop {
        row.stop = Some(StopReason::Interrupted);
        return false;
    }
    true
}

/// One position of rejection sampling: accept draft `d` with probability min(1, p(d)/q(d)),
/// else draw from the residual max(p − q, 0). p is the target's distribution after the
/// request's filters and temperature; `q` is the drafter's at this position.
fn rejection_step(
    target_logits: &[f32],
    q: &[f32],
    d: u32,
    request: &Request,
    step: u64,
) -> Result<(u32, bool), GenerateError> {
    let params = &request.sampling;
    let lp = filtered_logprobs(target_logits, params);
    let (support, p) = softmax_at_temperature(&lp, params.temperature);
    let key = step_key(params.seed ^ REJECTION_STREAM, step);
    let (pd, qd) = (p[d as usize] as f64, q[d as usize] as f64);
    if qd <= 0.0 || uniform(key, 0) < (pd / qd).min(1.0) {
        return Ok((d, true));
    }
    // The residual is zero off p's support: the draw below walks the support in token order,
    // which skips only zeros, and so draws what a walk over every token draws.
    let residual: Vec<(usize, f64)> = support.iter().map(|&t| (t, (p[t] as f64 - q[t] as f64).max(0.0))).collect();
    let mass: f64 = residual.iter().map(|&(_, r)| r).sum();
    if mass <= 1e-12 {
        return Ok((gumbel_argmax(&lp, params.temperature, params.seed, step), false));
    }
    let mut u = uniform(key, 1) * mass;
    for &(token, r) in &residual {
        if u < r {
            return Ok((token as u32, false));
        }
        u -= r;
    }
    Ok((residual.iter().rfind(|&&(_, r)| r > 0.0).map_or(0, |&(t, _)| t) as u32, false))
}

/// Keeps rejection draws apart from the coupled draws of the same step.
pub(super) const REJECTION_STREAM: u64 = 0x5EC0_17AB_1E5A_3B1D;

/// The tokens not removed (above -inf), in order, and softmax(logprobs / T) in double
/// precision, 0 for removed tokens. Those get no exponential each: after top-p they are nearly
/// the whole vocabulary, and a double-precision exponential per token was a third of a
/// rejection step. Their zeros would not change the sum, so the result is the same.
pub(super) fn softmax_at_temperature(logprobs: &[f32], temperature: f32) -> (Vec<usize>, Vec<f32>) {
    let scaled = |x: f32| x as f64 / temperature as f64;
    let support: Vec<usize> = (0..logprobs.len()).filter(|&t| logprobs[t] > f32::NEG_INFINITY).collect();
    let max = support.iter().map(|&t| scaled(logprobs[t])).fold(f64::NEG_INFINITY, f64::max);
    let exp: Vec<f64> = support.iter().map(|&t| (scaled(logprobs[t]) - max).exp()).collect();
    let total: f64 = exp.iter().sum();
    let mut p = vec![0f32; logprobs.len()];
    for (&t, &e) in support.iter().zip(&exp) {
        p[t] = (e / total) as f32;
    }
    (support, p)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sampling::SamplingParams;
    use mlx_rs::Array;

    const V: usize = 8;
    const EOS: u32 = 1;

    /// Window logits whose argmax at position i is `argmax[i]`.
    fn window(argmax: &[u32]) -> Array {
        let mut flat = vec![0.0f32; argmax.len() * V];
        for (i, &t) in argmax.iter().enumerate() {
            flat[i * V + t as usize] = 5.0;
        }
        Array::from_slice(&flat, &[argmax.len() as i32, V as i32])
    }

    fn request(max_tokens: usize, temperature: f32) -> Request {
        Request {
            prompt: vec![2],
            max_tokens,
            sampling: SamplingParams { temperature, seed: 3, ..Default::default() },
            eos: vec![EOS],
            ..Default::default()
        }
    }

    fn drafts(tokens: &[u32]) -> Proposal {
        Proposal { tokens: tokens.to_vec(), probabilities: None }
    }

    fn run(request: &Request, proposal: &Proposal, logits: &Array) -> (Row, usize, Vec<u32>) {
        let mut row = Row::new(request, 4);
        let mut emitted = Vec::new();
        let window = WindowTokens::new(logits, &request.sampling).unwrap();
        let n = accept(&mut row, request, proposal, &window, Verify::Match, |t, _| {
            emitted.push(t);
            Flow::Continue
        })
        .unwrap();
        (row, n, emitted)
    }

    #[test]
    fn agreeing_drafts_are_all_taken_with_the_bonus_token() {
        let (row, n, emitted) = run(&request(10, 0.0), &drafts(&[5, 7]), &window(&[5, 7, 3]));
        assert_eq!((n, emitted.clone()), (2, vec![5, 7, 3]));
        assert_eq!(row.tokens, emitted);
        assert_eq!(row.pending, 3);
        assert_eq!((row.stats.drafted, row.stats.accepted, row.stats.rounds), (2, 2, 1));
        assert_eq!(row.by_position[..2], [(1, 1), (1, 1)]);
        assert_eq!(row.stop, None);
    }

    #[test]
    fn the_first_disagreement_ends_the_round_with_the_targets_token() {
        let (row, n, emitted) = run(&request(10, 0.0), &drafts(&[5, 6, 4]), &window(&[5, 7, 3, 2]));
        assert_eq!((n, emitted), (1, vec![5, 7]));
        assert_eq!(row.pending, 7);
        assert_eq!(row.by_position[..3], [(1, 1), (1, 0), (1, 0)]);
    }

    #[test]
    fn without_drafts_the_target_decodes_one_token() {
        let (row, n, emitted) = run(&request(10, 0.0), &drafts(&[]), &window(&[6]));
        assert_eq!((n, emitted, row.stats.drafted), (0, vec![6], 0));
    }

    #[test]
    fn end_of_sequence_stops_and_is_not_emitted() {
        let (row, _, emitted) = run(&request(10, 0.0), &drafts(&[5, EOS, 4]), &window(&[5, EOS, 4, 4]));
        assert_eq!(emitted, vec![5]);
        assert_eq!(row.stop, Some(StopReason::Eos));
        assert_eq!(row.pending, 5);
    }

    #[test]
    fn max_tokens_is_exact_inside_a_window() {
        let (row, _, emitted) = run(&request(2, 0.0), &drafts(&[5, 7, 3]), &window(&[5, 7, 3, 2]));
        assert_eq!(emitted, vec![5, 7]);
        assert_eq!(row.stop, Some(StopReason::MaxTokens));
    }

    /// Draft probabilities [D, V] with `q` on every row.
    fn probabilities(q: &[f32], rows: usize) -> Array {
        Array::from_slice(&q.repeat(rows), &[rows as i32, V as i32])
    }

    #[test]
    fn rejection_takes_drafts_the_target_would_draw_as_likely() {
        // q = p: min(1, p/q) = 1 at every position, whatever was drafted.
        let logits: Vec<f32> = (0..V).map(|v| v as f32 * 0.3).collect();
        let request = request(10, 1.0);
        let (_, p) = softmax_at_temperature(&filtered_logprobs(&logits, &request.sampling), 1.0);
        let proposal = Proposal { tokens: vec![0, 3, 6], probabilities: Some(probabilities(&p, 3)) };
        let window = Array::from_slice(&logits.repeat(4), &[4, V as i32]);
        let mut row = Row::new(&request, 4);
        let window = WindowTokens::new(&window, &request.sampling).unwrap();
        let n = accept(&mut row, &request, &proposal, &window, Verify::Rejection, |_, _| Flow::Continue).unwrap();
        assert_eq!(n, 3);
        assert_eq!(row.tokens[..3], [0, 3, 6]);
    }

    #[test]
    fn rejection_never_takes_a_draft_the_target_cannot_draw() {
        // The target gives token 2 no mass (top_k = 1 keeps only token 5); a residual draw
        // must then come from the target's support.
        let mut logits = [0.0f32; V];
        logits[5] = 4.0;
        let mut request = request(10, 1.0);
        request.sampling.top_k = 1;
        let q = [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        for seed in 0..20 {
            request.sampling.seed = seed;
            let proposal = Proposal { tokens: vec![2], probabilities: Some(probabilities(&q, 1)) };
            let window = Array::from_slice(&logits.repeat(2), &[2, V as i32]);
            let mut row = Row::new(&request, 4);
            let window = WindowTokens::new(&window, &request.sampling).unwrap();
            let n = accept(&mut row, &request, &proposal, &window, Verify::Rejection, |_, _| Flow::Continue).unwrap();
            assert_eq!((n, row.tokens.clone()), (0, vec![5]), "seed {seed}");
        }
    }
}

//! What a verify forward costs this target at each window width, measured once per loaded
//! target the first time a batch drafts `"auto"`, for [`super::depth::RoundCosts`].

use std::time::Instant;

use mlx_rs::Array;

use super::depth::AUTO_MOST;
use crate::generate::GenerateError;
use crate::model::Gemma4;

/// Timings of each width, taken in passes over every width, so that a spell of load on the
/// machine (other processes, other tests) falls on all widths alike rather than on a run of
/// them, which would tilt the line and with it every depth chosen; the fastest counts (the
/// machine's noise only adds).
const REPEATS: usize = 3;

/// Milliseconds of a one-row forward and its logits over n tokens (index n − 1), for n up to
/// one more than [`AUTO_MOST`]. The ranks of a tensor-parallel target each measure, as every
/// forward is collective, and take rank 0's numbers, so that they choose the same depths.
pub(super) fn verify_ms(model: &Gemma4) -> Result<Vec<f64>, GenerateError> {
    if let Some(ms) = model.verify_ms.get() {
        return Ok(ms.clone());
    }
    let widths = AUTO_MOST + 1;
    // A warm-up forward: the first touches weights and buffers the others find ready.
    forward_ms(model, widths)?;
    let mut ms = vec![f64::INFINITY; widths];
    for _ in 0..REPEATS {
        for (n, best) in (1..=widths).zip(&mut ms) {
            *best = best.min(forward_ms(model, n)?);
        }
    }
    if let Some(group) = model.group {
        let bytes: Vec<u8> = ms.iter().flat_map(|v| v.to_le_bytes()).collect();
        let agreed = group.broadcast(&bytes)?;
        ms = agreed.chunks_exact(8).map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes"))).collect();
    }
    Ok(model.verify_ms.get_or_init(|| ms).clone())
}

/// One forward over `n` tokens on fresh caches, as a verify window of `n` tokens computes it.
fn forward_ms(model: &Gemma4, n: usize) -> Result<f64, GenerateError> {
    let mut caches = model.make_caches(1, AUTO_MOST + 1);
    // Ordinary ids: tokens past the first few, where special ones sit.
    let vocab = model.config.vocab_size;
    let ids: Vec<i32> = (0..n as i32).map(|i| (10 + i) % vocab).collect();
    let ids = Array::from_slice(&ids, &[1, n as i32]);
    let start = Instant::now();
    let hidden = model.forward_hidden(&ids, &mut caches, None)?;
    let logits = model.logits_from_hidden(&hidden)?;
    plugin_api::nn::sync::eval([&logits])?;
    Ok(start.elapsed().as_secs_f64() * 1e3)
}

//! Vector passes over a vocabulary (a quarter of a megabyte of logits, or a megabyte at Gemma
//! 4's size): each chunk's largest value, and the tokens at or above a value.

/// Tokens per chunk of [`chunk_maxima`].
pub const CHUNK: usize = 64;

/// The largest value of each `CHUNK` of `values` (-inf for a chunk of removed tokens).
pub fn chunk_maxima(values: &[f32]) -> Vec<f32> {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { chunk_maxima_avx2(values) };
    }
    chunk_maxima_body(values)
}

/// The finite tokens of `values` at or above `cut`, in token order.
pub fn at_or_above(values: &[f32], cut: f32) -> Vec<u32> {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked above).
        return unsafe { at_or_above_avx2(values, cut) };
    }
    at_or_above_body(values, cut)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn chunk_maxima_avx2(values: &[f32]) -> Vec<f32> {
    chunk_maxima_body(values)
}

/// [`at_or_above_body`] with each eight values' comparison read as eight bits of a mask.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn at_or_above_avx2(values: &[f32], cut: f32) -> Vec<u32> {
    use std::arch::x86_64::*;
    let mut tokens = Vec::new();
    let (cut8, removed8) = (_mm256_set1_ps(cut), _mm256_set1_ps(f32::NEG_INFINITY));
    let mut eights = values.chunks_exact(8);
    for (w, eight) in (&mut eights).enumerate() {
        let x = _mm256_loadu_ps(eight.as_ptr());
        let kept = _mm256_and_ps(_mm256_cmp_ps::<_CMP_GE_OQ>(x, cut8), _mm256_cmp_ps::<_CMP_NEQ_OQ>(x, removed8));
        let mut bits = _mm256_movemask_ps(kept) as u32;
        while bits != 0 {
            tokens.push((w * 8) as u32 + bits.trailing_zeros());
            bits &= bits - 1;
        }
    }
    let rest = values.len() - eights.remainder().len();
    tokens.extend(at_or_above_body(eights.remainder(), cut).into_iter().map(|t| t + rest as u32));
    tokens
}

fn lane_max(a: f32, b: f32) -> f32 {
    if b > a {
        b
    } else {
        a
    }
}

/// Eight running maxima a chunk, one per lane of a vector, then the eight's.
#[inline(always)]
fn chunk_maxima_body(values: &[f32]) -> Vec<f32> {
    values
        .chunks(CHUNK)
        .map(|chunk| {
            let mut lanes = [f32::NEG_INFINITY; 8];
            let mut rows = chunk.chunks_exact(8);
            for row in &mut rows {
                for (m, &x) in lanes.iter_mut().zip(row) {
                    *m = lane_max(*m, x);
                }
            }
            rows.remainder().iter().chain(&lanes).copied().fold(f32::NEG_INFINITY, lane_max)
        })
        .collect()
}

fn at_or_above_body(values: &[f32], cut: f32) -> Vec<u32> {
    (0..values.len() as u32).filter(|&t| values[t as usize] >= cut && values[t as usize] > f32::NEG_INFINITY).collect()
}

/// The positions of the non-zero bytes of `flags` (each 0 or 1), read eight at a time.
#[inline(always)]
pub fn set_flags(flags: &[u8]) -> impl Iterator<Item = usize> + '_ {
    flags.chunks(8).enumerate().flat_map(|(w, eight)| {
        let mut word = [0u8; 8];
        word[..eight.len()].copy_from_slice(eight);
        let mut bits = u64::from_le_bytes(word);
        std::iter::from_fn(move || {
            let byte = (bits != 0).then(|| bits.trailing_zeros() as usize / 8)?;
            bits &= bits - 1;
            Some(w * 8 + byte)
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vector_passes_equal_plain_loops() {
        for n in [0usize, 1, 7, 63, 64, 65, 1000, 4099] {
            let values: Vec<f32> = (0..n)
                .map(|i| match i % 11 {
                    3 => f32::NEG_INFINITY,
                    _ => ((crate::sampling::uniform(5, i as u64) - 0.5) * 40.0) as f32,
                })
                .collect();
            let maxima: Vec<f32> =
                values.chunks(CHUNK).map(|c| c.iter().copied().fold(f32::NEG_INFINITY, f32::max)).collect();
            assert_eq!(chunk_maxima(&values), maxima, "{n} values");
            assert_eq!(chunk_maxima_body(&values), maxima, "{n} values");
            for cut in [f32::NEG_INFINITY, -5.0, 0.0, 19.0] {
                let above: Vec<u32> = (0..n as u32)
                    .filter(|&t| values[t as usize] >= cut && values[t as usize] > f32::NEG_INFINITY)
                    .collect();
                assert_eq!(at_or_above(&values, cut), above, "{n} values, cut {cut}");
                assert_eq!(at_or_above_body(&values, cut), above, "{n} values, cut {cut}");
            }
        }
    }
}

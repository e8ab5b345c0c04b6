//! Sums of AVX-512 accumulators, shared by the AVX-512 product loops: each output's sixteen
//! lanes are added by one fixed tree, so a row's result never depends on the tile it fell in.

use std::arch::x86_64::*;

/// Whether the CPU has what these sums need (AVX-512 F, VL and DQ): the base of every AVX-512
/// route.
pub fn available() -> bool {
    crate::simd::has!("avx512f") && crate::simd::has!("avx512vl") && crate::simd::has!("avx512dq")
}

/// Writes the sums of a register tile's accumulators: `acc[j][b]` is output o + j of x row
/// m0 + b, and goes to y[(m0 + b) * n + o + j].
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512dq")]
pub unsafe fn store_sums<const XB: usize, const WB: usize>(
    acc: [[__m512; XB]; WB],
    y: &mut [f32],
    m0: usize,
    o: usize,
    n: usize,
) {
    if XB * WB >= 8 {
        // Up to four rows at a time: slot 4j + b holds output j of row b, so row b's outputs
        // come out side by side, in the result's 128-bit lane b.
        for first in (0..XB).step_by(4) {
            let rows = (XB - first).min(4);
            let mut slots = [_mm512_setzero_ps(); 16];
            for j in 0..WB {
                for b in 0..rows {
                    slots[4 * j + b] = acc[j][first + b];
                }
            }
            let sums = sum_lanes_16(slots);
            for b in 0..rows {
                let row = match b {
                    0 => _mm512_extractf32x4_ps::<0>(sums),
                    1 => _mm512_extractf32x4_ps::<1>(sums),
                    2 => _mm512_extractf32x4_ps::<2>(sums),
                    _ => _mm512_extractf32x4_ps::<3>(sums),
                };
                _mm_mask_storeu_ps(y.as_mut_ptr().add((m0 + first + b) * n + o), (1u8 << WB) - 1, row);
            }
        }
    } else {
        for j in 0..WB {
            for b in 0..XB {
                y[(m0 + b) * n + o + j] = sum_lanes(acc[j][b]);
            }
        }
    }
}

/// The sum of v's sixteen lanes by halves: lane i + lane i + 8, then i + i + 4, i + i + 2 and
/// i + i + 1. Every sum of these loops takes this tree, alone or with fifteen others in
/// [`sum_lanes_16`], so a row's result never depends on its tile.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512dq")]
pub unsafe fn sum_lanes(v: __m512) -> f32 {
    let eight = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps::<1>(v));
    let four = _mm_add_ps(_mm256_castps256_ps128(eight), _mm256_extractf128_ps::<1>(eight));
    let two = _mm_add_ps(four, _mm_movehl_ps(four, four));
    let one = _mm_add_ss(two, _mm_movehdup_ps(two));
    _mm_cvtss_f32(one)
}

/// [`sum_lanes`] of sixteen vectors at once, the same additions shuffled together: element
/// 4q + e of the result is the sum of `v[4e + q]`. About three operations per sum instead
/// of eight, which at a model's short rows (256 inputs: eight multiply-adds per output) is
/// much of a product's work.
#[inline]
#[target_feature(enable = "avx512f,avx512vl,avx512dq")]
unsafe fn sum_lanes_16(v: [__m512; 16]) -> __m512 {
    // (Explicit loops: closures would not inherit the target features.)
    // Lanes i and i + 8 (256-bit halves), two vectors per result: quarter q of s[k] holds
    // half q % 2 of v[2k + q / 2]'s eight sums.
    let mut s = [_mm512_setzero_ps(); 8];
    for k in 0..8 {
        let (a, b) = (v[2 * k], v[2 * k + 1]);
        s[k] = _mm512_add_ps(_mm512_shuffle_f32x4::<0x44>(a, b), _mm512_shuffle_f32x4::<0xEE>(a, b));
    }
    // Lanes i and i + 4: quarter q of t[m] holds the four sums of v[4m + q].
    let mut t = [_mm512_setzero_ps(); 4];
    for m in 0..4 {
        let (a, b) = (s[2 * m], s[2 * m + 1]);
        t[m] = _mm512_add_ps(_mm512_shuffle_f32x4::<0x88>(a, b), _mm512_shuffle_f32x4::<0xDD>(a, b));
    }
    // Lanes i and i + 2: in each quarter q of u[n], two sums of v[8n + q], then two of
    // v[8n + 4 + q].
    let mut u = [_mm512_setzero_ps(); 2];
    for n in 0..2 {
        let (a, b) = (t[2 * n], t[2 * n + 1]);
        u[n] = _mm512_add_ps(_mm512_shuffle_ps::<0x44>(a, b), _mm512_shuffle_ps::<0xEE>(a, b));
    }
    // Lanes i and i + 1.
    _mm512_add_ps(_mm512_shuffle_ps::<0x88>(u[0], u[1]), _mm512_shuffle_ps::<0xDD>(u[0], u[1]))
}

/// Asks for the line at element `i` of each of `rows` rows of `k` elements from `first`: where
/// a register tile reads its own rows, in the rows after them (see `dot`'s `RegisterTile`).
///
/// Into L2, not L1: on Zen 4, asked for into L1, a 1.3B model decoded at 24 against 34 tok/s in
/// 4 bits and 11 against 15 in bfloat16 (`host run`, two runs each way), and the AVX2 loops
/// gained too. (Likely because a core holds far fewer misses into L1 than into L2 at once, so
/// requests for L1 queue behind the loads' own.)
#[inline(always)]
pub fn prefetch_lines<T>(first: *const T, k: usize, rows: usize, i: usize) {
    for j in 0..rows {
        // SAFETY: a prefetch is a hint that never faults, whatever the address; SSE is part of
        // x86-64.
        unsafe { _mm_prefetch::<_MM_HINT_T1>(first.wrapping_add(j * k + i).cast()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sixteen sums at once are each what the one-vector tree gives, bit for bit, on lanes
    /// of mixed magnitudes where any other pairing would round differently.
    #[test]
    fn sixteen_sums_at_once_are_each_sums_own() {
        if !available() {
            return;
        }
        let value = |i: usize| ((i * 2654435761) % 2003) as f32 * 10f32.powi((i % 7) as i32 - 3) - 700.0;
        for trial in 0..50 {
            let lanes: Vec<[f32; 16]> =
                (0..16).map(|v| std::array::from_fn(|l| value(trial * 256 + v * 16 + l))).collect();
            // SAFETY: the CPU has the features (checked above); loads read 16 floats each.
            unsafe {
                let vectors: [__m512; 16] = std::array::from_fn(|v| _mm512_loadu_ps(lanes[v].as_ptr()));
                let mut together = [0f32; 16];
                _mm512_storeu_ps(together.as_mut_ptr(), sum_lanes_16(vectors));
                for (s, &sum) in together.iter().enumerate() {
                    let (q, e) = (s / 4, s % 4);
                    assert_eq!(sum.to_bits(), sum_lanes(vectors[4 * e + q]).to_bits(), "slot {s}");
                }
            }
        }
    }
}

//! The best of a few candidate rows of a table by their dot product with a vector: the
//! assistant drafter's centroid head, which scores a few hundred of the vocabulary's rows.

/// A table's rows: bfloat16 bits or float32.
pub trait Row: Copy {
    fn widen(self) -> f32;

    /// Eight values from `p`, widened.
    ///
    /// # Safety
    /// The CPU must have AVX2; `p` points at eight readable values.
    #[cfg(target_arch = "x86_64")]
    unsafe fn widen8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl Row for u16 {
    #[inline(always)]
    fn widen(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn widen8(p: *const u16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let halves = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(halves))
    }
}

impl Row for f32 {
    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn widen8(p: *const f32) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

/// The candidate whose row of `table` has the largest dot product with `x` (its length is the
/// row length), each rounded to bfloat16 if asked; among equal scores the lowest id. `None` if
/// no score is above -inf. Each score is the sum, in order, of eight lanes, lane i summing
/// `r[j]·x[j]` for j ≡ i (mod 8) in order (a multiply, then an add), then the rest in order.
pub fn best_token<T: Row>(table: &[T], x: &[f32], candidates: &[i32], to_bf16: bool) -> Option<i32> {
    best_tokens(table, x, candidates, to_bf16, 1).first().copied()
}

/// The `n` candidates of the largest scores of [`best_token`], best first, equal scores by
/// lower id; fewer where fewer score above -inf.
pub fn best_tokens<T: Row>(table: &[T], x: &[f32], candidates: &[i32], to_bf16: bool, n: usize) -> Vec<i32> {
    let d = x.len();
    let mut best: Vec<(f32, i32)> = Vec::with_capacity(n + 1);
    let mut offer = |t: i32, lanes: [f32; 8]| {
        let row = &table[t as usize * d..(t as usize + 1) * d];
        let whole = d / 8 * 8;
        let rest: f32 = row[whole..].iter().zip(&x[whole..]).map(|(&r, &x)| r.widen() * x).sum();
        let score = lanes.iter().sum::<f32>() + rest;
        let score = if to_bf16 { rounded_to_bf16(score) } else { score };
        let better = |&(s, u): &(f32, i32)| score > s || (score == s && t < u);
        if score > f32::NEG_INFINITY && (best.len() < n || best.last().is_some_and(better)) {
            let at = best.iter().position(better).unwrap_or(best.len());
            best.insert(at, (score, t));
            best.truncate(n);
        }
    };
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has!("avx2") {
        for group in candidates.chunks(SIDE_BY_SIDE) {
            // SAFETY: the CPU has AVX2 (checked above); every candidate's row lies in the table.
            let lanes = unsafe { lanes_avx2(table, x, candidates, group) };
            for (&t, lanes) in group.iter().zip(lanes) {
                offer(t, lanes);
            }
        }
        return best.into_iter().map(|(_, t)| t).collect();
    }
    for &t in candidates {
        let row = &table[t as usize * d..(t as usize + 1) * d];
        let mut lanes = [0f32; 8];
        for (r, x) in row.chunks_exact(8).zip(x.chunks_exact(8)) {
            for i in 0..8 {
                lanes[i] += r[i].widen() * x[i];
            }
        }
        offer(t, lanes);
    }
    best.into_iter().map(|(_, t)| t).collect()
}

/// Candidates summed side by side: one candidate's lanes form a chain of dependent adds, whose
/// latency a lone candidate waits on; four chains keep the adders busy.
#[cfg(target_arch = "x86_64")]
const SIDE_BY_SIDE: usize = 4;

/// The eight lane sums of each candidate of `group` (a run of `candidates` of at most
/// [`SIDE_BY_SIDE`]), summed as [`best_token`] says.
///
/// # Safety
/// The CPU must have AVX2; every candidate's row lies in `table`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn lanes_avx2<T: Row>(table: &[T], x: &[f32], candidates: &[i32], group: &[i32]) -> [[f32; 8]; SIDE_BY_SIDE] {
    use std::arch::x86_64::*;
    let d = x.len();
    // Candidates' rows lie anywhere in the table, where the hardware cannot guess the next: the
    // next group's rows are asked for while this one is summed.
    let next = (group.as_ptr().offset_from(candidates.as_ptr()) as usize) + group.len();
    for &ahead in candidates.iter().skip(next).take(SIDE_BY_SIDE) {
        let ahead = table.as_ptr().add(ahead as usize * d) as *const i8;
        for line in (0..d * std::mem::size_of::<T>()).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(ahead.add(line));
        }
    }
    // A short last group repeats its first candidate, whose extra sums are not returned.
    let rows: [*const T; SIDE_BY_SIDE] =
        std::array::from_fn(|c| table.as_ptr().add(*group.get(c).unwrap_or(&group[0]) as usize * d));
    let mut sums = [_mm256_setzero_ps(); SIDE_BY_SIDE];
    for at in (0..d / 8 * 8).step_by(8) {
        let xs = _mm256_loadu_ps(x.as_ptr().add(at));
        for c in 0..SIDE_BY_SIDE {
            sums[c] = _mm256_add_ps(sums[c], _mm256_mul_ps(T::widen8(rows[c].add(at)), xs));
        }
    }
    let mut lanes = [[0f32; 8]; SIDE_BY_SIDE];
    for (lanes, sums) in lanes.iter_mut().zip(sums) {
        _mm256_storeu_ps(lanes.as_mut_ptr(), sums);
    }
    lanes
}

/// `x` rounded to the nearest bfloat16, ties to even (x is finite).
fn rounded_to_bf16(x: f32) -> f32 {
    let bits = x.to_bits();
    f32::from_bits(bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) & 0xffff_0000)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The n best are the first n of the candidates by score (as `best_token` scores them), then
    /// by lower id, and the first is `best_token`'s; values in quarters make ties.
    #[test]
    fn the_n_best_are_the_head_of_the_sorted_scores() {
        let (d, rows) = (20, 64);
        let mut state = 9u32;
        let mut next = || {
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (((state >> 8) as f32 / (1u32 << 24) as f32 - 0.5) * 4.0).round() / 4.0
        };
        let table: Vec<f32> = (0..rows * d).map(|_| next()).collect();
        let x: Vec<f32> = (0..d).map(|_| next()).collect();
        let candidates: Vec<i32> = (0..rows as i32).rev().step_by(2).chain([3, 5, 7]).collect();
        for to_bf16 in [false, true] {
            // Each score as the doc says it is summed, then every candidate sorted.
            let score = |t: i32| {
                let row = &table[t as usize * d..(t as usize + 1) * d];
                let mut lanes = [0f32; 8];
                for (r, x) in row.chunks_exact(8).zip(x.chunks_exact(8)) {
                    for i in 0..8 {
                        lanes[i] += r[i] * x[i];
                    }
                }
                let whole = d / 8 * 8;
                let rest: f32 = row[whole..].iter().zip(&x[whole..]).map(|(r, x)| r * x).sum();
                let s = lanes.iter().sum::<f32>() + rest;
                if to_bf16 {
                    rounded_to_bf16(s)
                } else {
                    s
                }
            };
            let mut sorted = candidates.clone();
            sorted.sort_by(|&a, &b| score(b).total_cmp(&score(a)).then(a.cmp(&b)));
            let n = 6;
            assert!(sorted.windows(2).take(n).any(|w| score(w[0]) == score(w[1])), "no ties to break");
            assert_eq!(best_tokens(&table, &x, &candidates, to_bf16, n), sorted[..n]);
            assert_eq!(best_token(&table, &x, &candidates, to_bf16), Some(sorted[0]));
        }
    }
}

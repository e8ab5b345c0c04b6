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
    let d = x.len();
    let mut best = (f32::NEG_INFINITY, i32::MAX);
    let mut offer = |t: i32, lanes: [f32; 8]| {
        let row = &table[t as usize * d..(t as usize + 1) * d];
        let whole = d / 8 * 8;
        let rest: f32 = row[whole..].iter().zip(&x[whole..]).map(|(&r, &x)| r.widen() * x).sum();
        let score = lanes.iter().sum::<f32>() + rest;
        let score = if to_bf16 { rounded_to_bf16(score) } else { score };
        if score > best.0 || (score == best.0 && t < best.1) {
            best = (score, t);
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
        return (best.1 != i32::MAX).then_some(best.1);
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
    (best.1 != i32::MAX).then_some(best.1)
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

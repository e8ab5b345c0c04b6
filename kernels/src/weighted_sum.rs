//! `out[b, :] = Σ_j p[b, j] · v[j, :]` for rows v [s, d] of float32 or half precision:
//! attention's probabilities times its values, the values read where the cache holds them.
//!
//! The product loops of [`super::dot`] would want the values as a weight [d, s], a transposed
//! copy of every head's whole context per layer and step; in a decode step of eight requests
//! that copy took most of attention's time. Here each output element is one float32 accumulator
//! that takes its terms in key order, one fused multiply-add each, on every route. So:
//! - the routes (AVX-512, AVX2, portable) agree bit for bit;
//! - a key whose probability is zero (a masked slot, wherever it sits) leaves the sum as it was,
//!   so a row's attention is the same alone or batched with longer rows;
//! - each query row is summed on its own, the same in a verify window as in a one-token step.

use crate::weight::Floats;

/// How the tiles read a value: the format as a constant, so that each tile compiles to one
/// kind of load.
const BF16: u8 = 0;
const F16: u8 = 1;
const F32: u8 = 2;

/// Fills `out` [rows, d] with the weighted sums of the rows of `v` [s, d] by the weights `p`
/// [rows, s].
pub fn weighted_sum(p: &[f32], rows: usize, s: usize, v: Floats, d: usize, out: &mut [f32]) {
    assert!(p.len() == rows * s && v.len() == s * d && out.len() == rows * d, "weighted_sum: operand sizes");
    #[cfg_attr(not(target_arch = "x86_64"), allow(unused_mut))]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    {
        if super::lanes::available() {
            // SAFETY: the CPU has AVX-512 F (checked by `available`); the sizes are checked above.
            done = unsafe { avx512::columns(p, rows, s, v, d, out) };
        } else if crate::simd::has!("avx2") && crate::simd::has!("fma") && crate::simd::has!("f16c") {
            // SAFETY: the CPU has AVX2, FMA and F16C (checked above); the sizes are checked above.
            done = unsafe { avx2::columns(p, rows, s, v, d, out) };
        }
    }
    portable(p, rows, s, v, d, done..d, out);
}

/// Columns `columns` of every output row, one element at a time.
fn portable(p: &[f32], rows: usize, s: usize, v: Floats, d: usize, columns: std::ops::Range<usize>, out: &mut [f32]) {
    let value = |i: usize| match v {
        Floats::F32(v) => v[i],
        Floats::Bf16(v) => f32::from_bits((v[i] as u32) << 16),
        Floats::F16(v) => half::f16::from_bits(v[i]).to_f32(),
    };
    for b in 0..rows {
        for c in columns.clone() {
            let mut acc = 0f32;
            for j in 0..s {
                acc = p[b * s + j].mul_add(value(j * d + c), acc);
            }
            out[b * d + c] = acc;
        }
    }
}

/// Covers the whole vectors of columns of `out` with tiles of up to `max_b` rows × `max_c`
/// vectors of `lanes` floats, calling `tile(b, c, at)` for each; returns how many leading columns
/// that filled.
#[allow(clippy::too_many_arguments)]
#[cfg(target_arch = "x86_64")]
unsafe fn tiled(
    p: &[f32],
    rows: usize,
    s: usize,
    v: Floats,
    d: usize,
    out: &mut [f32],
    [lanes, max_b, max_c]: [usize; 3],
    tile: impl Fn(u8, usize, usize, At),
) -> usize {
    let (kind, v, size) = match v {
        Floats::F32(v) => (F32, v.as_ptr() as *const u8, 4),
        Floats::Bf16(v) => (BF16, v.as_ptr() as *const u8, 2),
        Floats::F16(v) => (F16, v.as_ptr() as *const u8, 2),
    };
    let whole = d / lanes * lanes;
    for b0 in (0..rows).step_by(max_b) {
        let b = (rows - b0).min(max_b);
        let mut c0 = 0;
        while c0 < whole {
            let c = ((whole - c0) / lanes).min(max_c);
            let at =
                At { p: p.as_ptr().add(b0 * s), s, v: v.add(c0 * size), d, out: out.as_mut_ptr().add(b0 * d + c0) };
            tile(kind, b, c, at);
            c0 += c * lanes;
        }
    }
    whole
}

/// Where a tile works: weights from `p` (rows `s` apart), values from column `v` (rows `d`
/// values apart, each of the tile's format), outputs from `out` (rows `d` apart).
#[derive(Clone, Copy)]
#[cfg(target_arch = "x86_64")]
struct At {
    p: *const f32,
    s: usize,
    v: *const u8,
    d: usize,
    out: *mut f32,
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::__m512;

    use crate::weight::Floats;

    /// Whole vectors of columns (see [`super::tiled`]): tiles of up to 4 rows × 4 vectors, sixteen
    /// accumulators.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn columns(p: &[f32], rows: usize, s: usize, v: Floats, d: usize, out: &mut [f32]) -> usize {
        super::tiled(p, rows, s, v, d, out, [16, 4, 4], |kind, b, c, at| match kind {
            super::BF16 => dispatch::<{ super::BF16 }>(b, c, at),
            super::F16 => dispatch::<{ super::F16 }>(b, c, at),
            _ => dispatch::<{ super::F32 }>(b, c, at),
        })
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn dispatch<const KIND: u8>(b: usize, c: usize, at: super::At) {
        super::tile_of_shape::<__m512, KIND>(b, c, at)
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::__m256;

    use crate::weight::Floats;

    /// Whole vectors of columns (see [`super::tiled`]): tiles of up to 2 rows × 4 vectors, so
    /// that the sums, four vectors of values and a weight fit in sixteen registers.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn columns(p: &[f32], rows: usize, s: usize, v: Floats, d: usize, out: &mut [f32]) -> usize {
        super::tiled(p, rows, s, v, d, out, [8, 2, 4], |kind, b, c, at| match kind {
            super::BF16 => dispatch::<{ super::BF16 }>(b, c, at),
            super::F16 => dispatch::<{ super::F16 }>(b, c, at),
            _ => dispatch::<{ super::F32 }>(b, c, at),
        })
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn dispatch<const KIND: u8>(b: usize, c: usize, at: super::At) {
        super::tile_of_shape::<__m256, KIND>(b, c, at)
    }
}

/// A vector of floats and the few operations a tile needs, for AVX-512's sixteen lanes and
/// AVX2's eight; inlined into the routes' functions, which enable the instructions.
#[cfg(target_arch = "x86_64")]
trait Lanes: Copy {
    const LANES: usize;
    unsafe fn zero() -> Self;
    /// LANES values of format KIND ([`BF16`], [`F16`] or [`F32`]) as floats.
    unsafe fn load<const KIND: u8>(v: *const u8) -> Self;
    unsafe fn splat(x: f32) -> Self;
    /// a · b + acc, rounded once.
    unsafe fn fma(a: Self, b: Self, acc: Self) -> Self;
    unsafe fn store(self, out: *mut f32);
}

#[cfg(target_arch = "x86_64")]
impl Lanes for std::arch::x86_64::__m512 {
    const LANES: usize = 16;
    #[inline(always)]
    unsafe fn zero() -> Self {
        std::arch::x86_64::_mm512_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load<const KIND: u8>(v: *const u8) -> Self {
        use std::arch::x86_64::*;
        if KIND == F32 {
            return _mm512_loadu_ps(v as *const f32);
        }
        let halves = _mm256_loadu_si256(v as *const __m256i);
        if KIND == BF16 {
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(halves)))
        } else {
            _mm512_cvtph_ps(halves)
        }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        std::arch::x86_64::_mm512_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, acc: Self) -> Self {
        std::arch::x86_64::_mm512_fmadd_ps(a, b, acc)
    }
    #[inline(always)]
    unsafe fn store(self, out: *mut f32) {
        std::arch::x86_64::_mm512_storeu_ps(out, self)
    }
}

#[cfg(target_arch = "x86_64")]
impl Lanes for std::arch::x86_64::__m256 {
    const LANES: usize = 8;
    #[inline(always)]
    unsafe fn zero() -> Self {
        std::arch::x86_64::_mm256_setzero_ps()
    }
    #[inline(always)]
    unsafe fn load<const KIND: u8>(v: *const u8) -> Self {
        use std::arch::x86_64::*;
        if KIND == F32 {
            return _mm256_loadu_ps(v as *const f32);
        }
        let halves = _mm_loadu_si128(v as *const __m128i);
        if KIND == BF16 {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
        } else {
            _mm256_cvtph_ps(halves)
        }
    }
    #[inline(always)]
    unsafe fn splat(x: f32) -> Self {
        std::arch::x86_64::_mm256_set1_ps(x)
    }
    #[inline(always)]
    unsafe fn fma(a: Self, b: Self, acc: Self) -> Self {
        std::arch::x86_64::_mm256_fmadd_ps(a, b, acc)
    }
    #[inline(always)]
    unsafe fn store(self, out: *mut f32) {
        std::arch::x86_64::_mm256_storeu_ps(out, self)
    }
}

/// [`tile`] of `b` rows × `c` vectors (each at most 4): the sizes as constants, so that the
/// sums stay in registers.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile_of_shape<V: Lanes, const KIND: u8>(b: usize, c: usize, at: At) {
    match (b, c) {
        (1, 1) => tile::<V, 1, 1, KIND>(at),
        (1, 2) => tile::<V, 1, 2, KIND>(at),
        (1, 3) => tile::<V, 1, 3, KIND>(at),
        (1, 4) => tile::<V, 1, 4, KIND>(at),
        (2, 1) => tile::<V, 2, 1, KIND>(at),
        (2, 2) => tile::<V, 2, 2, KIND>(at),
        (2, 3) => tile::<V, 2, 3, KIND>(at),
        (2, 4) => tile::<V, 2, 4, KIND>(at),
        (3, 1) => tile::<V, 3, 1, KIND>(at),
        (3, 2) => tile::<V, 3, 2, KIND>(at),
        (3, 3) => tile::<V, 3, 3, KIND>(at),
        (3, 4) => tile::<V, 3, 4, KIND>(at),
        (4, 1) => tile::<V, 4, 1, KIND>(at),
        (4, 2) => tile::<V, 4, 2, KIND>(at),
        (4, 3) => tile::<V, 4, 3, KIND>(at),
        (4, 4) => tile::<V, 4, 4, KIND>(at),
        _ => unreachable!("tiles of at most 4 × 4"),
    }
}

/// B output rows × C vectors of columns: for each key j in turn, its values (C vectors) times
/// each row's weight, added into that row's sums.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
unsafe fn tile<V: Lanes, const B: usize, const C: usize, const KIND: u8>(at: At) {
    let size = if KIND == F32 { 4 } else { 2 };
    let mut acc = [[V::zero(); C]; B];
    for j in 0..at.s {
        let values: [V; C] = std::array::from_fn(|c| V::load::<KIND>(at.v.add((j * at.d + V::LANES * c) * size)));
        for (b, acc) in acc.iter_mut().enumerate() {
            let weight = V::splat(*at.p.add(b * at.s + j));
            for (acc, &value) in acc.iter_mut().zip(&values) {
                *acc = V::fma(weight, value, *acc);
            }
        }
    }
    for (b, acc) in acc.iter().enumerate() {
        for (c, &acc) in acc.iter().enumerate() {
            acc.store(at.out.add(b * at.d + V::LANES * c));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values with every kind of bit pattern a cache holds (signs, small and large exponents),
    /// none of them NaN or infinite.
    fn values(n: usize, bf16: bool, seed: u32) -> Vec<u16> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let bits = (state >> 16) as u16;
                let exponent_mask = if bf16 { 0x7F80 } else { 0x7C00 };
                if bits & exponent_mask == exponent_mask {
                    bits & !0x4000
                } else {
                    bits
                }
            })
            .collect()
    }

    fn weights(n: usize, seed: u32) -> Vec<f32> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (state >> 8) as f32 / (1u32 << 24) as f32
            })
            .collect()
    }

    /// float32 values from the same patterns, as bfloat16 widened plus low bits.
    fn f32_values(n: usize, seed: u32) -> Vec<f32> {
        values(n, true, seed)
            .iter()
            .zip(values(n, true, seed + 1))
            .map(|(&h, l)| f32::from_bits((h as u32) << 16 | l as u32))
            .collect()
    }

    #[test]
    fn every_route_sums_in_key_order_like_the_portable_loop() {
        for format in ["bfloat16", "float16", "float32"] {
            for (rows, s, d) in
                [(1, 1, 16), (1, 37, 64), (3, 200, 128), (4, 33, 256), (5, 9, 72), (8, 64, 64), (2, 5, 7)]
            {
                let (halves, singles) = (values(s * d, format == "bfloat16", 11), f32_values(s * d, 11));
                let v = match format {
                    "bfloat16" => Floats::Bf16(&halves),
                    "float16" => Floats::F16(&halves),
                    _ => Floats::F32(&singles),
                };
                let p = weights(rows * s, 7);
                let mut slow = vec![f32::NAN; rows * d];
                portable(&p, rows, s, v, d, 0..d, &mut slow);
                let mut routes: Vec<(&str, Vec<f32>)> = Vec::new();
                let mut chosen = vec![f32::NAN; rows * d];
                weighted_sum(&p, rows, s, v, d, &mut chosen);
                routes.push(("chosen", chosen));
                #[cfg(target_arch = "x86_64")]
                {
                    if crate::simd::has!("avx2") && crate::simd::has!("fma") && crate::simd::has!("f16c") {
                        let mut out = slow.clone();
                        // SAFETY: the CPU has the features (checked above); the sizes match.
                        let done = unsafe { avx2::columns(&p, rows, s, v, d, &mut out) };
                        assert_eq!(done, d / 8 * 8);
                        routes.push(("avx2", out));
                    }
                    if crate::lanes::available() {
                        let mut out = slow.clone();
                        // SAFETY: the CPU has AVX-512 F (checked above); the sizes match.
                        let done = unsafe { avx512::columns(&p, rows, s, v, d, &mut out) };
                        assert_eq!(done, d / 16 * 16);
                        routes.push(("avx512", out));
                    }
                }
                for (route, out) in &routes {
                    for (i, (a, b)) in out.iter().zip(&slow).enumerate() {
                        assert_eq!(a.to_bits(), b.to_bits(), "{route}: {format} rows {rows} s {s} d {d} element {i}");
                    }
                }
            }
        }
    }

    #[test]
    fn keys_of_zero_weight_change_nothing_wherever_they_sit() {
        let (rows, s, d) = (3, 40, 64);
        let (p, v) = (weights(rows * s, 3), values(s * d, true, 5));
        let mut alone = vec![0f32; rows * d];
        weighted_sum(&p, rows, s, Floats::Bf16(&v), d, &mut alone);
        // Six masked keys: two before, one in the middle, three after.
        let padded_at = [0usize, 0, 20, 40, 40, 40];
        let mut padded_p = Vec::new();
        let mut padded_v = Vec::new();
        for b in 0..rows {
            let mut row: Vec<f32> = p[b * s..(b + 1) * s].to_vec();
            for &at in padded_at.iter().rev() {
                row.insert(at, 0.0);
            }
            padded_p.extend(row);
        }
        let mut keys: Vec<Vec<u16>> = v.chunks(d).map(<[u16]>::to_vec).collect();
        for &at in padded_at.iter().rev() {
            keys.insert(at, values(d, true, 99 + at as u32));
        }
        keys.iter().for_each(|k| padded_v.extend(k));
        let t = s + padded_at.len();
        let mut padded = vec![0f32; rows * d];
        weighted_sum(&padded_p, rows, t, Floats::Bf16(&padded_v), d, &mut padded);
        assert_eq!(
            alone.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            padded.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }
}

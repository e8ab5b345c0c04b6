//! Host arrays as the CPU loops read and write them: an MLX array's data as a slice (row-major,
//! evaluated), widened to float32 or read as half-precision bit patterns, and results rounded
//! back to an array of the activation dtype as MLX rounds them.

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

/// Calls `f` with the data of `a` (row-major, evaluated) as float32, widening half precision.
pub fn with_floats<R>(a: &Array, f: impl FnOnce(&[f32]) -> R) -> Result<R, Exception> {
    match a.dtype() {
        Dtype::Float32 => Ok(f(slice::<f32>(a).ok_or_else(|| Exception::custom("float32 data"))?)),
        Dtype::Bfloat16 | Dtype::Float16 => {
            let bits = bits16(a).ok_or_else(|| Exception::custom("half-precision data"))?;
            let widened: Vec<f32> = match a.dtype() {
                Dtype::Bfloat16 => widened_bf16(bits),
                _ => bits.iter().map(|&b| half::f16::from_bits(b).to_f32()).collect(),
            };
            Ok(f(&widened))
        }
        other => Err(Exception::custom(format!("data of {other:?}"))),
    }
}

/// Rounding to a dtype as a type of its own. A loop over elements written against `impl Round`
/// compiles once per dtype, to vector code; one that tests the dtype at every element stays
/// scalar, and in a verify window's elementwise ops that cost as much as the products.
pub(crate) trait Round: Copy {
    /// `v` rounded as [`round_to`] rounds it.
    fn round(self, v: f32) -> f32;
}

#[derive(Clone, Copy)]
pub(crate) struct ToBf16;
#[derive(Clone, Copy)]
pub(crate) struct ToF16;
#[derive(Clone, Copy)]
pub(crate) struct Exact;

impl Round for ToBf16 {
    #[inline(always)]
    fn round(self, v: f32) -> f32 {
        f32::from_bits((bf16_bits(v) as u32) << 16)
    }
}

impl Round for ToF16 {
    #[inline(always)]
    fn round(self, v: f32) -> f32 {
        half::f16::from_f32(v).to_f32()
    }
}

impl Round for Exact {
    #[inline(always)]
    fn round(self, v: f32) -> f32 {
        v
    }
}

/// A function whose body is compiled three times, with AVX-512, with AVX2 and for the crate's
/// baseline (x86-64, whose vectors hold four floats), and run with the widest the CPU has: for
/// the elementwise loops that every op's result passes through, which the compiler vectorizes
/// sixteen floats at a time given AVX-512, twice AVX2's eight.
macro_rules! avx2_where_available {
    ($(#[$meta:meta])* $vis:vis fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block) => {
        $(#[$meta])*
        $vis fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx2")]
            unsafe fn avx2($($arg: $ty),*) $(-> $ret)? {
                body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq")]
            unsafe fn avx512($($arg: $ty),*) $(-> $ret)? {
                body($($arg),*)
            }
            #[cfg(target_arch = "x86_64")]
            if crate::simd::has!("avx512f")
                && crate::simd::has!("avx512bw")
                && crate::simd::has!("avx512vl")
                && crate::simd::has!("avx512dq")
            {
                // SAFETY: the CPU has AVX-512 F, BW, VL and DQ (checked above).
                return unsafe { avx512($($arg),*) };
            }
            #[cfg(target_arch = "x86_64")]
            if crate::simd::has!("avx2") {
                // SAFETY: the CPU has AVX2 (checked above).
                return unsafe { avx2($($arg),*) };
            }
            body($($arg),*)
        }
    };
}
pub(crate) use avx2_where_available;

/// `$body` with `$r` bound to the [`Round`] of `$dtype` (float32's for any other dtype).
macro_rules! with_round {
    ($dtype:expr, |$r:ident| $body:expr) => {
        match $dtype {
            mlx_rs::Dtype::Bfloat16 => {
                let $r = $crate::arrays::ToBf16;
                $body
            }
            mlx_rs::Dtype::Float16 => {
                let $r = $crate::arrays::ToF16;
                $body
            }
            _ => {
                let $r = $crate::arrays::Exact;
                $body
            }
        }
    };
}
pub(crate) use with_round;

/// `v` rounded to `dtype` (to nearest, ties to even, as MLX converts), kept as float32: what an
/// MLX op of that dtype does to each result.
#[inline(always)]
pub(crate) fn round_to(dtype: Dtype, v: f32) -> f32 {
    with_round!(dtype, |r| r.round(v))
}

/// The bfloat16 nearest `v` (ties to even; a NaN stays a quiet NaN), as `half::bf16::from_f32`
/// rounds, without its branches: loops over elements that round through it compile to vector
/// code, where `half`'s conversion left the elementwise ops of a verify window scalar.
#[inline(always)]
pub(crate) fn bf16_bits(v: f32) -> u16 {
    let x = v.to_bits();
    let nearest = x.wrapping_add(0x7FFF + ((x >> 16) & 1)) >> 16;
    let quiet_nan = (x >> 16) | 0x0040;
    (if x & 0x7FFF_FFFF > 0x7F80_0000 { quiet_nan } else { nearest }) as u16
}

/// A value as the elementwise loops read and write it: a float32, or a bfloat16's bits (read
/// without a widened copy of the array, written rounded by [`bf16_bits`]).
pub(crate) trait Value: Copy {
    fn as_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
}

impl Value for f32 {
    #[inline(always)]
    fn as_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> f32 {
        v
    }
}

impl Value for u16 {
    #[inline(always)]
    fn as_f32(self) -> f32 {
        f32::from_bits((self as u32) << 16)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> u16 {
        bf16_bits(v)
    }
}

/// [`bf16_bits`] of 16 floats at once.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) unsafe fn bf16_bits_avx512(v: std::arch::x86_64::__m512) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    let x = _mm512_castps_si512(v);
    let upper = _mm512_srli_epi32::<16>(x);
    let lowest_kept = _mm512_and_si512(upper, _mm512_set1_epi32(1));
    let nearest =
        _mm512_srli_epi32::<16>(_mm512_add_epi32(x, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lowest_kept)));
    let magnitude = _mm512_and_si512(x, _mm512_set1_epi32(0x7FFF_FFFF));
    let nan = _mm512_cmpgt_epu32_mask(magnitude, _mm512_set1_epi32(0x7F80_0000));
    let quiet_nan = _mm512_or_si512(upper, _mm512_set1_epi32(0x0040));
    _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, nearest, quiet_nan))
}

/// The bfloat16 bit patterns of `values`, each rounded by [`bf16_bits`] (every product's
/// outputs and most elementwise ops' results pass through here).
pub(crate) fn bf16_all(values: &[f32]) -> Vec<u16> {
    let mut bits = vec![0u16; values.len()];
    bf16_into(values, &mut bits);
    bits
}

/// [`bf16_all`] into `bits` (as long as `values`).
pub(crate) fn bf16_into(values: &[f32], bits: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if bf16_conversion() {
        // SAFETY: the CPU has AVX-512 F, DQ and BF16 (checked above).
        return unsafe { bf16_into_avx512(values, bits) };
    }
    bf16_into_loop(values, bits)
}

avx2_where_available! {
    /// [`bf16_into`] one value at a time.
    fn bf16_into_loop(values: &[f32], bits: &mut [u16]) {
        for (b, &v) in bits.iter_mut().zip(values) {
            *b = bf16_bits(v);
        }
    }
}

/// Whether the CPU converts float32 to bfloat16 itself (AVX-512 BF16, with F and DQ).
#[cfg(target_arch = "x86_64")]
fn bf16_conversion() -> bool {
    static HAS: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *HAS.get_or_init(|| crate::simd::has!("avx512bf16") && crate::simd::has!("avx512dq"))
}

/// [`bf16_into`] 32 values per `vcvtne2ps2bf16`, which rounds as [`bf16_bits`] does (to nearest
/// even, NaNs quieted the same way) except that it reads denormals as zero: a run of 32 that
/// holds one takes the loop instead.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512dq,avx512bf16")]
unsafe fn bf16_into_avx512(values: &[f32], bits: &mut [u16]) {
    use std::arch::x86_64::*;
    const DENORMAL: i32 = 0x20;
    assert_eq!(values.len(), bits.len());
    let runs = values.len() / 32;
    for (from, to) in values.chunks_exact(32).zip(bits.chunks_exact_mut(32)) {
        let (low, high) = (_mm512_loadu_ps(from.as_ptr()), _mm512_loadu_ps(from.as_ptr().add(16)));
        if _mm512_fpclass_ps_mask::<DENORMAL>(low) | _mm512_fpclass_ps_mask::<DENORMAL>(high) == 0 {
            _mm512_storeu_si512(
                to.as_mut_ptr().cast(),
                std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(high, low)),
            );
        } else {
            bf16_into_loop(from, to);
        }
    }
    bf16_into_loop(&values[runs * 32..], &mut bits[runs * 32..]);
}

avx2_where_available! {
    /// Bfloat16 bit patterns widened to float32.
    pub(crate) fn widened_bf16(bits: &[u16]) -> Vec<f32> {
        let mut values = vec![0f32; bits.len()];
        for (v, &b) in values.iter_mut().zip(bits) {
            *v = f32::from_bits((b as u32) << 16);
        }
        values
    }
}

/// An elementwise op of bfloat16 operands whose result is rounded once to bfloat16.
#[derive(Clone, Copy)]
pub(crate) enum Bf16Op<'a> {
    /// a + b.
    Add(&'a [u16]),
    /// a · s.
    Scale(f32),
}

avx2_where_available! {
    /// `op` over the bfloat16 bit patterns `a`, as bit patterns: widened, computed in float32
    /// and rounded once, as MLX's binary ops compute it.
    pub(crate) fn bf16_elementwise(a: &[u16], op: Bf16Op) -> Vec<u16> {
        let widen = |b: u16| f32::from_bits((b as u32) << 16);
        let mut out = vec![0u16; a.len()];
        match op {
            Bf16Op::Add(b) => {
                for ((y, &a), &b) in out.iter_mut().zip(a).zip(b) {
                    *y = bf16_bits(widen(a) + widen(b));
                }
            }
            Bf16Op::Scale(s) => {
                for (y, &a) in out.iter_mut().zip(a) {
                    *y = bf16_bits(widen(a) * s);
                }
            }
        }
        out
    }
}

/// An array of `shape` holding `values` rounded to `dtype` (float32, bfloat16 or float16).
pub fn rounded(values: &[f32], shape: &[i32], dtype: Dtype) -> Array {
    match dtype {
        Dtype::Bfloat16 => from_bits16(&bf16_all(values), shape, dtype),
        Dtype::Float16 => Array::from_slice(&values.iter().map(|&v| half::f16::from_f32(v)).collect::<Vec<_>>(), shape),
        _ => Array::from_slice(values, shape),
    }
}

/// `a` itself when its data is laid out row-major, else a row-major copy; evaluated either way,
/// so that its data can be read.
pub fn row_major(a: &Array) -> Result<Array, Exception> {
    a.eval()?;
    let mut contiguous = false;
    // SAFETY: `a` is a valid, evaluated array; the call writes one bool.
    unsafe { mlx_sys::_mlx_array_is_row_contiguous(&mut contiguous, a.as_ptr()) };
    if contiguous {
        Ok(a.clone())
    } else {
        let copy = a.contiguous()?;
        copy.eval()?;
        Ok(copy)
    }
}

/// The data of `a` when it is laid out row-major (evaluating it first).
pub(crate) fn slice<T: mlx_rs::ArrayElement>(a: &Array) -> Option<&[T]> {
    a.try_as_slice::<T>().ok()
}

/// The 16-bit patterns of a bfloat16 or float16 array.
pub fn bits16(a: &Array) -> Option<&[u16]> {
    let (ptr, len) = match a.dtype() {
        Dtype::Bfloat16 => slice::<half::bf16>(a).map(|v| (v.as_ptr().cast::<u16>(), v.len()))?,
        Dtype::Float16 => slice::<half::f16>(a).map(|v| (v.as_ptr().cast::<u16>(), v.len()))?,
        _ => return None,
    };
    // SAFETY: bf16 and f16 are transparent 16-bit values; the slice borrows `a`.
    Some(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// An array of `shape` and half-precision `dtype` (bfloat16 or float16) holding these bit
/// patterns.
pub fn from_bits16(bits: &[u16], shape: &[i32], dtype: Dtype) -> Array {
    // SAFETY: bf16 and f16 are transparent 16-bit values, as u16 is.
    match dtype {
        Dtype::Bfloat16 => Array::from_slice(unsafe { &*(bits as *const [u16] as *const [half::bf16]) }, shape),
        Dtype::Float16 => Array::from_slice(unsafe { &*(bits as *const [u16] as *const [half::f16]) }, shape),
        other => panic!("from_bits16: {other:?} is not a half-precision dtype"),
    }
}

/// A scalar in `dtype`, so that it does not promote the array it meets (Python floats are
/// weakly typed in MLX; a Rust f32 array is not).
///
/// Made as data, rounded to nearest even as MLX's conversion rounds, rather than by converting
/// a float32 array: every MLX op costs microseconds of dispatch on the CPU, and small models
/// meet scalars several times per layer.
pub fn scalar(value: f32, dtype: Dtype) -> Result<Array, Exception> {
    match dtype {
        Dtype::Float32 => Ok(Array::from_f32(value)),
        Dtype::Bfloat16 => Ok(Array::from_slice(&[half::bf16::from_f32(value)], &[])),
        Dtype::Float16 => Ok(Array::from_slice(&[half::f16::from_f32(value)], &[])),
        _ => Array::from_f32(value).as_dtype(dtype),
    }
}

//! tanh of float32 values in vector code, for the float32 softcap and GeGLU on the CPU.
//!
//! MLX's CPU tanh calls the C library's `tanhf` one element at a time, which costs tens of
//! nanoseconds a value: over a 262,144-token vocabulary that is milliseconds per row of logits,
//! and a verify window has several rows. Here tanh is branch-free arithmetic that compiles to
//! vector code: an odd polynomial near zero (Cephes' `tanhf` coefficients) and
//! 1 − 2 / (e^{2|x|} + 1) beyond, with MLX's own exponential ([`crate::exp::mlx_exp`]). It is
//! within a few units in the last place of `tanhf` (tested over every 61st float), not equal to
//! it bit for bit, so a float32 model's logits move in their last bits against mlx-lm's (the
//! parity tests allow 5e-4); half-precision dtypes keep their tables of MLX's exact results.

/// Below this |x| the polynomial is used (Cephes' split).
const SMALL: f32 = 0.625;

/// tanh(x) = x + x³·P(x²) below [`SMALL`]: P's coefficients, highest power first, as Cephes
/// writes them.
#[allow(clippy::excessive_precision, reason = "Cephes' coefficients as written")]
const NEAR_ZERO: [f32; 5] =
    [-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1, -3.33332819422e-1];

/// tanh(x) (NaN for NaN, ±1 from about ±9).
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let z = x * x;
    let mut p = NEAR_ZERO[0];
    for c in &NEAR_ZERO[1..] {
        p = p.mul_add(z, *c);
    }
    let near_zero = (p * z).mul_add(x, x).copysign(x);
    // e^{2|x|} stays finite up to |x| = 44; past 20, 2 / (e + 1) no longer moves 1.
    let e = exp_in_range(2.0 * x.abs().min(20.0));
    let far = (1.0 - 2.0 / (e + 1.0)).copysign(x);
    let y = if x.abs() < SMALL { near_zero } else { far };
    if x.is_nan() {
        x
    } else {
        y
    }
}

/// [`crate::exp::mlx_exp`] for x in [0, 40], without its range checks (branches would keep the
/// loops scalar).
#[inline(always)]
fn exp_in_range(x: f32) -> f32 {
    let x = x * crate::exp::LOG2_E;
    let whole = (x + 0.5).floor();
    let fraction = x - whole;
    let mut p = crate::exp::EXP_POLYNOMIAL[0];
    for c in &crate::exp::EXP_POLYNOMIAL[1..] {
        p = p.mul_add(fraction, *c);
    }
    f32::from_bits(((whole as i32 + 127) << 23) as u32) * p
}

/// `f` over `values`, in loops compiled for AVX2 and FMA where the CPU has them (the same
/// results either way: `mul_add` is fused in both).
pub fn map(values: &[f32], f: impl Fn(f32) -> f32 + Copy) -> Vec<f32> {
    let mut out = vec![0f32; values.len()];
    zip_into(values, values, &mut out, |v, _| f(v));
    out
}

/// `out[i] = f(a[i], b[i])`, in the loops of [`map`].
pub fn zip_into(a: &[f32], b: &[f32], out: &mut [f32], f: impl Fn(f32, f32) -> f32 + Copy) {
    assert!(a.len() == out.len() && b.len() == out.len(), "zip_into: operand lengths");
    #[cfg(target_arch = "x86_64")]
    if crate::simd::has!("avx2") && crate::simd::has!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { zip_into_avx2(a, b, out, f) };
    }
    for ((out, &a), &b) in out.iter_mut().zip(a).zip(b) {
        *out = f(a, b);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn zip_into_avx2(a: &[f32], b: &[f32], out: &mut [f32], f: impl Fn(f32, f32) -> f32 + Copy) {
    // (An explicit loop: an iterator's closure would not inherit the target features.)
    for i in 0..out.len() {
        out[i] = f(a[i], b[i]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Units in the last place between a and b (same sign assumed near zero).
    fn ulps(a: f32, b: f32) -> u32 {
        (a.to_bits() as i64 - b.to_bits() as i64).unsigned_abs() as u32
    }

    #[test]
    fn within_a_few_units_in_the_last_place_of_the_c_librarys() {
        let mut worst = (0, 0f32);
        for bits in (0..=u32::MAX).step_by(61) {
            let x = f32::from_bits(bits);
            if x.is_nan() {
                assert!(tanh(x).is_nan());
                continue;
            }
            let d = ulps(tanh(x), x.tanh());
            if d > worst.0 {
                worst = (d, x);
            }
        }
        eprintln!("largest difference from tanhf: {} ulps at {:e}", worst.0, worst.1);
        assert!(worst.0 <= 4, "{} ulps at {:e}", worst.0, worst.1);
        for (x, y) in [(0.0f32, 0.0f32), (-0.0, -0.0), (f32::INFINITY, 1.0), (f32::NEG_INFINITY, -1.0), (20.0, 1.0)] {
            assert_eq!(tanh(x).to_bits(), y.to_bits(), "{x}");
        }
    }

    #[test]
    fn the_vector_loops_give_the_scalar_results() {
        let values: Vec<f32> = (0..4099).map(|i| (i as f32 - 2049.0) * 0.0137).collect();
        let mapped = map(&values, tanh);
        for (v, m) in values.iter().zip(&mapped) {
            assert_eq!(m.to_bits(), tanh(*v).to_bits(), "{v}");
        }
    }
}

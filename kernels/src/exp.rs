//! MLX's CPU exponential, reproduced bit for bit so that softmaxes and samplers computed here
//! agree with MLX's ops.

/// MLX's CPU exp (`simd::exp` in mlx/backend/cpu/simd/math.h): 2^(x·log₂e) as a power of two
/// times a degree-6 polynomial of the fractional part, with fused multiply-adds.
#[inline(always)]
pub fn mlx_exp(x0: f32) -> f32 {
    if x0.is_nan() {
        return x0;
    }
    if x0 > 88.0 {
        return f32::INFINITY;
    }
    if x0 < -88.0 {
        return 0.0;
    }
    let x = x0 * LOG2_E;
    let whole = (x + 0.5).floor();
    let fraction = x - whole;
    let mut p = EXP_POLYNOMIAL[0];
    for c in &EXP_POLYNOMIAL[1..] {
        p = p.mul_add(fraction, *c);
    }
    f32::from_bits(((whole as i32 + 127) << 23) as u32) * p
}

#[allow(clippy::approx_constant, reason = "MLX's literal, which its results follow")]
pub const LOG2_E: f32 = 1.442695;

/// 2^f for f in [-½, ½], highest power first.
#[allow(clippy::excessive_precision, reason = "MLX's coefficients as MLX writes them")]
pub const EXP_POLYNOMIAL: [f32; 7] = [
    1.535336188319500e-4,
    1.339887440266574e-3,
    9.618437357674640e-3,
    5.550332471162809e-2,
    2.402264791363012e-1,
    6.931472028550421e-1,
    1.0,
];

/// [`mlx_exp`] of eight values at once, each lane bit for bit the scalar result (tested).
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn mlx_exp8(x0: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_mul_ps(x0, _mm256_set1_ps(LOG2_E));
    let whole = _mm256_floor_ps(_mm256_add_ps(x, _mm256_set1_ps(0.5)));
    let fraction = _mm256_sub_ps(x, whole);
    let mut p = _mm256_set1_ps(EXP_POLYNOMIAL[0]);
    for c in &EXP_POLYNOMIAL[1..] {
        p = _mm256_fmadd_ps(p, fraction, _mm256_set1_ps(*c));
    }
    // Lanes out of range are replaced below, whatever their integer conversion gave.
    let exponent = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvttps_epi32(whole), _mm256_set1_epi32(127)));
    let e = _mm256_mul_ps(_mm256_castsi256_ps(exponent), p);
    let e = _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LT_OQ>(x0, _mm256_set1_ps(-88.0)));
    let e = _mm256_blendv_ps(e, _mm256_set1_ps(f32::INFINITY), _mm256_cmp_ps::<_CMP_GT_OQ>(x0, _mm256_set1_ps(88.0)));
    _mm256_blendv_ps(e, x0, _mm256_cmp_ps::<_CMP_UNORD_Q>(x0, x0))
}

#[cfg(all(test, target_arch = "x86_64"))]
mod exp_tests {
    use std::arch::x86_64::*;

    #[test]
    fn eight_exponentials_at_once_are_the_scalar_ones() {
        if !(crate::simd::has!("avx2") && crate::simd::has!("fma")) {
            return;
        }
        // Every 97th float32 bit pattern: NaNs, infinities, subnormals and both ends of the range.
        let values: Vec<f32> = (0..u32::MAX / 97).map(|i| f32::from_bits(i * 97)).collect();
        for chunk in values.chunks_exact(8) {
            let mut lanes = [0f32; 8];
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), super::mlx_exp8(_mm256_loadu_ps(chunk.as_ptr()))) };
            for (lane, &x) in lanes.iter().zip(chunk) {
                assert_eq!(lane.to_bits(), super::mlx_exp(x).to_bits(), "exp({x})");
            }
        }
    }
}

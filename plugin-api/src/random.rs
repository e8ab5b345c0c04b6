//! The one source of randomness of host and drafters: counter-based draws that depend only on
//! a key and an index, so a draw is the same whenever it is asked for the same output position,
//! in any process, at any batch size.

/// The key of output position `step` under `seed`.
pub fn step_key(seed: u64, step: u64) -> u64 {
    splitmix(seed ^ (step.wrapping_add(1)).wrapping_mul(0x9E37_79B9_7F4A_7C15))
}

/// A uniform draw in (0, 1) for `index` under `key`: never 0 or 1, so `ln(u)` and
/// `ln(-ln(u))` are finite.
pub fn uniform(key: u64, index: u64) -> f64 {
    (uniform_bits(key, index) as f64 + 0.5) / (1u64 << 53) as f64
}

/// The 53 bits behind [`uniform`]: `uniform(key, index)` is `(bits + 0.5) / 2⁵³`. Inlined into
/// callers, so that a loop over many indices can compile to vector code.
#[inline(always)]
pub fn uniform_bits(key: u64, index: u64) -> u64 {
    splitmix(key ^ splitmix(index.wrapping_add(0xD1B5_4A32_D192_ED03))) >> 11
}

/// A token drawn from probabilities `q` (they need not be normalized) with the uniform `u`.
pub fn draw(q: &[f32], u: f64) -> u32 {
    let mut left = u * q.iter().map(|&p| p as f64).sum::<f64>();
    for (token, &p) in q.iter().enumerate() {
        if left < p as f64 {
            return token as u32;
        }
        left -= p as f64;
    }
    q.iter().rposition(|&p| p > 0.0).unwrap_or(0) as u32
}

#[inline(always)]
fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_are_strictly_inside_the_unit_interval_and_spread() {
        let draws: Vec<f64> = (0..10_000).map(|i| uniform(7, i)).collect();
        assert!(draws.iter().all(|&u| u > 0.0 && u < 1.0));
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
        assert_eq!(uniform(7, 3), uniform(7, 3));
        assert_ne!(uniform(7, 3), uniform(8, 3));
    }

    #[test]
    fn draw_follows_the_probabilities_and_skips_zeros() {
        assert_eq!(draw(&[0.0, 1.0, 0.0], 0.99), 1);
        assert_eq!(draw(&[0.25, 0.0, 0.75], 0.2), 0);
        assert_eq!(draw(&[0.25, 0.0, 0.75], 0.3), 2);
    }
}

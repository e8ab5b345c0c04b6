//! The greedy token of each row of logits, read on the host.

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::arrays::{bits16, row_major, with_floats};

/// The first largest value's index in each row of `x` [.., V], as MLX's argmax over the last
/// axis gives it, where the CPU route covers it; `None` for MLX's op. On the CPU MLX's arrays
/// live in host memory, and the op, its conversion and their round trip to MLX's stream thread
/// cost several times the scan over a small vocabulary.
pub fn argmax_rows(x: &Array) -> Result<Option<Vec<u32>>, Exception> {
    if !crate::route::on_cpu() {
        return Ok(None);
    }
    let width = x.shape().last().map_or(1, |&v| v.max(1) as usize);
    let x = row_major(x)?;
    if let Some(bits) = bits16(&x) {
        let best: Option<Vec<u32>> = bits.chunks(width).map(|row| first_max_half(row, x.dtype())).collect();
        if let Some(best) = best {
            return Ok(Some(best));
        }
    }
    with_floats(&x, |all| all.chunks(width).map(first_max).collect()).map(Some)
}

/// The index of the largest value, the first among equals (as MLX's argmax).
pub fn first_max(values: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in values.iter().enumerate() {
        if x > values[best] {
            best = i;
        }
    }
    best as u32
}

/// [`first_max`] of half-precision values held as bit patterns (bfloat16 or float16, as `dtype`
/// says), read without widening them: the greedy token of a row of logits; `None` if any value
/// is infinite or NaN.
pub fn first_max_half(bits: &[u16], dtype: Dtype) -> Option<u32> {
    let exponent = if dtype == Dtype::Bfloat16 { 0x7F80 } else { 0x7C00 };
    let (mut best, mut non_finite) = (i16::MIN, false);
    for &b in bits {
        best = best.max(ordered(b));
        non_finite |= b & exponent == exponent;
    }
    if non_finite {
        return None;
    }
    Some(bits.iter().position(|&b| ordered(b) == best).unwrap_or(0) as u32)
}

/// A finite half-precision value's bit pattern as an integer in the values' order: a sign and a
/// magnitude made one signed number, so −0 and +0 (which compare equal) are both 0.
#[inline(always)]
fn ordered(bits: u16) -> i16 {
    let magnitude = (bits & 0x7FFF) as i16;
    if bits & 0x8000 == 0 {
        magnitude
    } else {
        -magnitude
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_max_of_half_bit_patterns_is_that_of_their_values() {
        for dtype in [Dtype::Bfloat16, Dtype::Float16] {
            let exponent = if dtype == Dtype::Bfloat16 { 0x7F80 } else { 0x7C00 };
            let widen = |b: u16| match dtype {
                Dtype::Bfloat16 => f32::from_bits((b as u32) << 16),
                _ => half::f16::from_bits(b).to_f32(),
            };
            let mut state = 12345u32;
            let mut next = || {
                state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                (state >> 16) as u16
            };
            for case in 0..400 {
                // Few distinct values, so that ties (and −0 against +0) are common.
                let pool: Vec<u16> = (0..1 + case % 7).map(|_| next()).chain([0x8000, 0x0000]).collect();
                let finite: Vec<u16> = pool.into_iter().filter(|b| b & exponent != exponent).collect();
                let row: Vec<u16> = (0..1 + case % 50).map(|_| finite[next() as usize % finite.len()]).collect();
                let values: Vec<f32> = row.iter().map(|&b| widen(b)).collect();
                assert_eq!(first_max_half(&row, dtype), Some(first_max(&values)), "{dtype:?} {row:04x?}");
                let mut spoiled = row.clone();
                spoiled[case % row.len()] = exponent | (case as u16 & 1);
                assert_eq!(first_max_half(&spoiled, dtype), None, "{dtype:?} {spoiled:04x?}");
            }
        }
    }
}

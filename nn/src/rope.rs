//! Rotary position embeddings: the default kind and Gemma 4's proportional kind, both
//! non-traditional (half-split), as mlx-lm builds them.

use mlx_rs::error::Exception;
use mlx_rs::Array;

use kernels::{row_major, with_floats};

#[derive(Clone)]
pub enum Rope {
    /// Rotates all `dims` with frequencies from `base`.
    Default { dims: i32, base: f32 },
    /// Rotates the first `rotated_dims` of `dims` with periods `factor·base^(2i/dims)`; the
    /// rest get infinite periods (no rotation). The periods are computed in f32 by MLX, as
    /// mlx-lm does, since host-side powers differ in the last bit.
    Proportional { dims: i32, freqs: Array },
}

impl Rope {
    pub fn proportional(dims: i32, rotated_dims: i32, base: f32, factor: f32) -> Result<Rope, Exception> {
        let exponents = Array::arange::<_, f32>(0.0, rotated_dims as f32, 2.0)?.divide(Array::from_f32(dims as f32))?;
        let periods = Array::from_f32(base).power(&exponents)?.multiply(Array::from_f32(factor))?;
        let identity = Array::full::<f32>(&[(dims - rotated_dims) / 2], Array::from_f32(f32::INFINITY))?;
        let freqs = mlx_rs::ops::concatenate(&[periods, identity], 0)?;
        Ok(Rope::Proportional { dims, freqs })
    }

    /// Rotates x [B, H, L, D] whose first position is `offset`.
    pub fn apply(&self, x: &Array, offset: i32) -> Result<Array, Exception> {
        self.apply_rows(x, &vec![offset; x.shape()[0] as usize])
    }

    /// Rotates x [B, H, L, D] whose row b starts at position `offsets[b]`.
    pub fn apply_rows(&self, x: &Array, offsets: &[i32]) -> Result<Array, Exception> {
        let dims = self.dims() as usize;
        if let Some(y) = kernels::rope::rotate(x, offsets, dims, || self.kind(), |probe| self.mlx_apply(probe, 0))? {
            return Ok(y);
        }
        if offsets.iter().all(|&o| o == offsets[0]) {
            return self.mlx_apply(x, offsets[0]);
        }
        let rows: Vec<Array> = offsets
            .iter()
            .enumerate()
            .map(|(r, &o)| self.mlx_apply(&x.take_axis(Array::from_slice(&[r as i32], &[1]), 0)?, o))
            .collect::<Result<_, _>>()?;
        mlx_rs::ops::concatenate(&rows, 0)
    }

    fn dims(&self) -> i32 {
        match self {
            Rope::Default { dims, .. } | Rope::Proportional { dims, .. } => *dims,
        }
    }

    /// What identifies this rope's cosines and sines: its dims with its base, or with its
    /// frequencies, as bits.
    fn kind(&self) -> Result<Vec<u32>, Exception> {
        Ok(match self {
            Rope::Default { dims, base } => vec![*dims as u32, base.to_bits()],
            // The frequencies are float32 as `proportional` makes them; reading them is no op.
            Rope::Proportional { dims, freqs } => with_floats(&row_major(freqs)?, |f| {
                std::iter::once(*dims as u32).chain(f.iter().map(|f| f.to_bits())).collect()
            })?,
        })
    }

    fn mlx_apply(&self, x: &Array, offset: i32) -> Result<Array, Exception> {
        match self {
            Rope::Default { dims, base } => mlx_rs::fast::rope(x, *dims, false, *base, 1.0, offset, None),
            Rope::Proportional { dims, freqs } => mlx_rs::fast::rope(x, *dims, false, None, 1.0, offset, freqs),
        }
    }
}

#[cfg(test)]
mod tests {
    use mlx_rs::random;

    use mlx_rs::Dtype;

    use super::*;

    #[test]
    fn rotations_equal_mlxs_bit_for_bit_at_every_offset() {
        let ropes = [
            Rope::Default { dims: 64, base: 10_000.0 },
            Rope::Default { dims: 32, base: 1_000_000.0 },
            Rope::proportional(128, 32, 1_000_000.0, 1.0).unwrap(),
        ];
        for (r, rope) in ropes.iter().enumerate() {
            let d = if r == 1 { 48 } else { rope.dims() };
            for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
                let key = random::key(r as u64).unwrap();
                let x = random::normal::<f32>(&[3, 2, 5, d], None, None, &key).unwrap().as_dtype(dtype).unwrap();
                // Far positions too: the table grows past its first size.
                let offsets = [0, 7, 3000];
                let ours = rope.apply_rows(&x, &offsets).unwrap();
                for (b, &offset) in offsets.iter().enumerate() {
                    let row = Array::from_slice(&[b as i32], &[1]);
                    let mlx = rope.mlx_apply(&x.take_axis(&row, 0).unwrap(), offset).unwrap();
                    let differing =
                        ours.take_axis(&row, 0).unwrap().ne(&mlx).unwrap().sum(None).unwrap().item_cast::<u32>();
                    assert_eq!(differing, 0, "rope {r}, {dtype:?}, offset {offset}");
                }
            }
        }
    }
}

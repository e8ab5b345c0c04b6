//! Rotary position embeddings: the default kind and Gemma 4's proportional kind, both
//! non-traditional (half-split), as mlx-lm builds them.

use mlx_rs::error::Exception;
use mlx_rs::Array;

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
        match self {
            Rope::Default { dims, base } => mlx_rs::fast::rope(x, *dims, false, *base, 1.0, offset, None),
            Rope::Proportional { dims, freqs } => mlx_rs::fast::rope(x, *dims, false, None, 1.0, offset, freqs),
        }
    }
}

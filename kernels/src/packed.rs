//! Weights held as tiles rather than as MLX's arrays.
//!
//! A plain bfloat16 weight is repacked once into the tile unit's tiles, and MLX's copy is
//! dropped: the tiles then serve every product with it ([`tiled_product`]), whatever its rows'
//! count, so that a row's result does not depend on it, and the weight takes no more memory
//! than as loaded. An MLX-quantized weight with bfloat16 scales and biases (as mlx-lm converts
//! bfloat16 checkpoints) is reordered likewise ([`amx_quantized`]), with its scales and biases,
//! at the bytes MLX's arrays took. The tiles serve the unit where this process may use it, else
//! the loops of `tiles_avx512` on a CPU with AVX-512 (both formats; a tile row is the pairs
//! that `vdpbf16ps` reads, and CPUs without it take FMAs that sum as it does), else, for
//! quantized weights on a CPU with AVX2 and no AVX-512, the loops of `tiles_avx2`
//! ([`amx_bf16::held`], [`amx_quantized::held`]).

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::amx_bf16::{self, Tiles};
use crate::amx_quantized::{self, QuantTiles};
use crate::arrays::{bits16, from_bits16, rounded, row_major, with_round};
use crate::product::{dequantized, tiled_product, token_ids, Quantization, Tiled};

/// A weight [n, k] held as tiles for the unit.
pub enum Packed {
    Bf16(Tiles),
    Quantized(QuantTiles),
}

impl Packed {
    /// `w` [n, k] repacked as tiles, where it is a plain bfloat16 matrix, the CPU route is taken
    /// and the CPU multiplies bfloat16 tiles ([`amx_bf16::held`]).
    pub fn plain(w: &Array) -> Option<Packed> {
        if w.dtype() != Dtype::Bfloat16 || w.ndim() != 2 || !crate::route::on_cpu() || !amx_bf16::held() {
            return None;
        }
        let (n, k) = (w.shape()[0] as usize, w.shape()[1] as usize);
        bits16(w).map(|bits| Packed::Bf16(Tiles::pack(bits, n, k)))
    }

    /// An MLX-quantized `w` [n, k·bits/32] reordered into tiles with its bfloat16 scales and
    /// biases, where the CPU route is taken and the CPU multiplies tiles ([`amx_quantized::held`]).
    pub fn quantized(w: &Array, scales: &Array, biases: &Array, q: Quantization) -> Option<Packed> {
        let (bits, group) = (q.bits as u32, q.group_size as usize);
        let applies = w.ndim() == 2
            && w.dtype() == Dtype::Uint32
            && scales.dtype() == Dtype::Bfloat16
            && biases.dtype() == Dtype::Bfloat16
            && QuantTiles::takes(bits, group)
            && crate::route::on_cpu()
            && amx_quantized::held();
        if !applies {
            return None;
        }
        let (n, k) = (w.shape()[0] as usize, w.shape()[1] as usize * 32 / bits as usize);
        let packed = row_major(w).ok()?;
        let (scales, biases) = (row_major(scales).ok()?, row_major(biases).ok()?);
        let packed = packed.try_as_slice::<u32>().ok()?;
        let (scales, biases) = (bits16(&scales)?, bits16(&biases)?);
        let fits = k.is_multiple_of(group) && scales.len() == n * (k / group) && biases.len() == scales.len();
        fits.then(|| Packed::Quantized(QuantTiles::pack(packed, scales, biases, n, k, bits, group)))
    }

    fn tiled(&self) -> Tiled<'_> {
        match self {
            Packed::Bf16(t) => Tiled::Bf16(t),
            Packed::Quantized(t) => Tiled::Quantized(t),
        }
    }

    /// Rows of the weight (its outputs).
    pub fn rows(&self) -> usize {
        match self {
            Packed::Bf16(t) => t.n,
            Packed::Quantized(t) => t.n,
        }
    }

    pub fn nbytes(&self) -> usize {
        match self {
            Packed::Bf16(t) => t.nbytes(),
            Packed::Quantized(t) => t.nbytes(),
        }
    }

    /// The weight as an MLX array (packed integers where quantized), rebuilt from the tiles.
    pub fn array(&self) -> Array {
        match self {
            Packed::Bf16(t) => from_bits16(&t.unpack(), &[t.n as i32, t.k as i32], Dtype::Bfloat16),
            Packed::Quantized(t) => {
                let words_per_row = t.k * t.bits as usize / 32;
                Array::from_slice(&t.unpack().0, &[t.n as i32, words_per_row as i32])
            }
        }
    }

    /// `x · wᵀ`: on the unit, or by MLX's op for rows the tiles do not take (of another width
    /// or dtype).
    pub fn product(&self, x: &Array, q: Option<Quantization>) -> Result<Array, Exception> {
        if let Some(y) = tiled_product(x, self.tiled())? {
            return Ok(y);
        }
        match (self, q) {
            (Packed::Quantized(t), Some(q)) => {
                let (_, s, b) = t.unpack();
                let params = |p: &[u16]| from_bits16(p, &[t.n as i32, (t.k / t.group) as i32], Dtype::Bfloat16);
                mlx_rs::ops::quantized_matmul(x, self.array(), params(&s), &params(&b), true, q.group_size, q.bits)
            }
            _ => x.matmul(self.array().t()),
        }
    }

    /// Rows `ids` (int32 or uint32, any shape) of a table held as tiles, as [ids' shape…, dims]
    /// bfloat16, dequantized as MLX's `dequantize` does where quantized; an id outside the table
    /// is an error that names it.
    pub fn take_rows(&self, ids: &Array) -> Result<Array, Exception> {
        let ids = row_major(ids)?;
        let Some(picked) = token_ids(&ids) else {
            return Err(Exception::custom(format!("token ids of {:?}, not int32 or uint32", ids.dtype())));
        };
        let (n, k) = match self {
            Packed::Bf16(t) => (t.n, t.k),
            Packed::Quantized(t) => (t.n, t.k),
        };
        if let Some(&id) = picked.iter().find(|&&id| id < 0 || id as usize >= n) {
            return Err(Exception::custom(format!("token id {id} outside the table's {n} rows")));
        }
        let mut shape = ids.shape().to_vec();
        shape.push(k as i32);
        match self {
            Packed::Bf16(tiles) => {
                let mut bits = Vec::with_capacity(picked.len() * k);
                for &id in &picked {
                    tiles.row(id as usize, &mut bits);
                }
                Ok(from_bits16(&bits, &shape, Dtype::Bfloat16))
            }
            Packed::Quantized(tiles) => {
                let mut values = Vec::with_capacity(picked.len() * k);
                with_round!(Dtype::Bfloat16, |r| {
                    for &id in &picked {
                        values.extend((0..k).map(|i| {
                            let (q, scale, bias) = tiles.weight_parts(id as usize, i);
                            dequantized(r, q, scale, bias)
                        }));
                    }
                });
                Ok(rounded(&values, &shape, Dtype::Bfloat16))
            }
        }
    }
}

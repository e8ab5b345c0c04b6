//! Linear layers and embeddings, plain or MLX-quantized (affine, per-group scales and biases),
//! loaded by tensor name with their shapes checked.

use std::sync::{Arc, OnceLock};

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use super::kernels::amx_bf16::{self, Tiles};
use super::weights::{Weights, WeightsError};
use super::{kernels, wide};

/// MLX affine quantization of one module: `bits` per weight, one scale and bias per
/// `group_size` weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Quantization {
    pub group_size: i32,
    pub bits: i32,
}

/// `y = x · Wᵀ`.
#[derive(Clone)]
pub struct Linear {
    pub weight: Array,
    pub scales: Option<Array>,
    pub biases: Option<Array>,
    pub quantization: Option<Quantization>,
    pub tiles: TileCache,
}

/// A bfloat16 weight repacked for AMX's tile unit on its first product, where the CPU has one
/// and `HOST_AMX=on` ([`amx_bf16`]), shared by clones. The repacked copy sits beside MLX's own
/// array (an embedding's rows are read from that), so the bfloat16 weights then take twice
/// their memory.
#[derive(Clone, Default)]
pub struct TileCache(Arc<OnceLock<Option<Tiles>>>);

impl TileCache {
    /// The tiles of `w` [n, k], made on first call; `None` where they do not apply.
    fn of(&self, w: &Array) -> Option<&Tiles> {
        if w.dtype() != Dtype::Bfloat16 || w.ndim() != 2 || !wide::on_cpu() || !amx_bf16::available() {
            return None;
        }
        let (n, k) = (w.shape()[0] as usize, w.shape()[1] as usize);
        self.0.get_or_init(|| kernels::bits16(w).map(|bits| Tiles::pack(bits, n, k))).as_ref()
    }
}

impl Linear {
    /// Loads `{prefix}.weight` of logical shape [out, in] (plus `.scales`/`.biases` when
    /// quantized).
    pub fn load(
        w: &Weights,
        prefix: &str,
        out_dims: i32,
        in_dims: i32,
        q: Option<Quantization>,
    ) -> Result<Linear, WeightsError> {
        let (weight, scales, biases) = load_matrix(w, prefix, out_dims, in_dims, q)?;
        Ok(Linear { weight, scales, biases, quantization: q, tiles: TileCache::default() })
    }

    /// A plain weight stored [in, out] and used as x·W (the DSpark format's layout), held as
    /// [out, in] like every other weight, so that its products take the host's loops.
    pub fn from_in_out(w: &Array) -> Result<Linear, Exception> {
        let weight = kernels::row_major(&w.t())?;
        weight.eval()?;
        Ok(Linear::plain(weight))
    }

    /// An unquantized weight [out, in].
    pub fn plain(weight: Array) -> Linear {
        Linear { weight, scales: None, biases: None, quantization: None, tiles: TileCache::default() }
    }

    pub fn forward(&self, x: &Array) -> Result<Array, Exception> {
        times_transposed(x, &self.weight, self.scales.as_ref(), self.biases.as_ref(), self.quantization, &self.tiles)
    }

    pub fn nbytes(&self) -> usize {
        nbytes(&self.weight, self.scales.as_ref(), self.biases.as_ref())
    }
}

/// A token embedding table [vocab, dims], which can also serve as the tied output head.
#[derive(Clone)]
pub struct Embedding {
    pub weight: Array,
    pub scales: Option<Array>,
    pub biases: Option<Array>,
    pub quantization: Option<Quantization>,
    /// The table as the head's tiles (see [`TileCache`]).
    pub tiles: TileCache,
}

impl Embedding {
    pub fn load(
        w: &Weights,
        prefix: &str,
        vocab: i32,
        dims: i32,
        q: Option<Quantization>,
    ) -> Result<Embedding, WeightsError> {
        let (weight, scales, biases) = load_matrix(w, prefix, vocab, dims, q)?;
        Ok(Embedding { weight, scales, biases, quantization: q, tiles: TileCache::default() })
    }

    /// Rows of the table for `ids` (any shape), dequantized when needed.
    pub fn embed(&self, ids: &Array) -> Result<Array, Exception> {
        if let (Some(scales), Some(biases), Some(q)) = (&self.scales, &self.biases, self.quantization) {
            if let Some(rows) = kernels::dequantized_rows(ids, &self.weight, scales, biases, q)? {
                return Ok(rows);
            }
        }
        let rows = match self.scales {
            None => super::layout::take_rows(&self.weight, ids)?,
            Some(_) => self.weight.take_axis(ids, 0)?,
        };
        match (&self.scales, self.quantization) {
            (Some(scales), Some(q)) => {
                let s = scales.take_axis(ids, 0)?;
                let b = self.biases.as_ref().map(|b| b.take_axis(ids, 0)).transpose()?;
                mlx_rs::ops::dequantize(&rows, &s, b.as_ref(), q.group_size, q.bits)
            }
            _ => Ok(rows),
        }
    }

    /// `x · tableᵀ`: logits over the vocabulary from hidden states.
    pub fn as_linear(&self, x: &Array) -> Result<Array, Exception> {
        times_transposed(x, &self.weight, self.scales.as_ref(), self.biases.as_ref(), self.quantization, &self.tiles)
    }

    pub fn nbytes(&self) -> usize {
        nbytes(&self.weight, self.scales.as_ref(), self.biases.as_ref())
    }

    /// The activation dtype the table produces.
    pub fn dtype(&self) -> Dtype {
        self.scales.as_ref().map_or(self.weight.dtype(), Array::dtype)
    }
}

/// `x · wᵀ` for a plain or quantized w [out, in].
fn times_transposed(
    x: &Array,
    w: &Array,
    scales: Option<&Array>,
    biases: Option<&Array>,
    q: Option<Quantization>,
    tiles: &TileCache,
) -> Result<Array, Exception> {
    // A weight's tiles serve every product of bfloat16 rows with it, whatever their count, so
    // that a row's result does not depend on it (see `kernels::small_product`). Rows of
    // another dtype never take them, and do not get the weight repacked.
    let tiled = if x.dtype() == Dtype::Bfloat16 { tiles.of(w) } else { None };
    if let Some(tiles) = tiled {
        if let Some(y) = kernels::tiled_product(x, tiles)? {
            return Ok(y);
        }
    }
    if let Some(y) = kernels::small_product(x, w, scales, biases, q)? {
        return Ok(y);
    }
    if wide::takes_float32_route(wide::rows(x), x.dtype(), scales.is_some()) {
        let w = match (scales, q) {
            (Some(scales), Some(q)) => {
                let biases = biases.map(wide::float32).transpose()?;
                mlx_rs::ops::dequantize(w, wide::float32(scales)?, biases.as_ref(), q.group_size, q.bits)?
            }
            _ => wide::float32(w)?,
        };
        return wide::float32(x)?.matmul(w.t())?.as_dtype(x.dtype());
    }
    match (scales, q) {
        (Some(scales), Some(q)) => mlx_rs::ops::quantized_matmul(x, w, scales, biases, true, q.group_size, q.bits),
        _ => x.matmul(w.t()),
    }
}

fn nbytes(w: &Array, scales: Option<&Array>, biases: Option<&Array>) -> usize {
    w.nbytes() + scales.map_or(0, Array::nbytes) + biases.map_or(0, Array::nbytes)
}

fn load_matrix(
    w: &Weights,
    prefix: &str,
    rows: i32,
    cols: i32,
    q: Option<Quantization>,
) -> Result<(Array, Option<Array>, Option<Array>), WeightsError> {
    let name = format!("{prefix}.weight");
    match q {
        None => Ok((w.shaped(&name, &[rows, cols])?, None, None)),
        Some(q) => {
            let weight = w.packed(&name, &[rows, cols * q.bits / 32])?;
            let groups = cols / q.group_size;
            let scales = w.shaped(&format!("{prefix}.scales"), &[rows, groups])?;
            let biases = w.shaped(&format!("{prefix}.biases"), &[rows, groups])?;
            Ok((weight, Some(scales), Some(biases)))
        }
    }
}

//! Linear layers and embeddings, plain or MLX-quantized (affine, per-group scales and biases),
//! loaded by tensor name with their shapes checked.

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

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
        Ok(Linear { weight, scales, biases, quantization: q })
    }

    /// A plain weight stored [in, out] and used as x·W (the DSpark format's layout), held as
    /// [out, in] like every other weight, so that its products take the host's loops.
    pub fn from_in_out(w: &Array) -> Result<Linear, Exception> {
        let weight = kernels::row_major(&w.t())?;
        weight.eval()?;
        Ok(Linear { weight, scales: None, biases: None, quantization: None })
    }

    pub fn forward(&self, x: &Array) -> Result<Array, Exception> {
        times_transposed(x, &self.weight, self.scales.as_ref(), self.biases.as_ref(), self.quantization)
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
        Ok(Embedding { weight, scales, biases, quantization: q })
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
        times_transposed(x, &self.weight, self.scales.as_ref(), self.biases.as_ref(), self.quantization)
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
) -> Result<Array, Exception> {
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

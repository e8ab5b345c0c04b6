//! Linear layers and embeddings, plain or MLX-quantized (affine, per-group scales and biases),
//! loaded by tensor name with their shapes checked.

use std::sync::Arc;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use kernels::Packed;
pub use kernels::Quantization;

use super::weights::{Weights, WeightsError};

/// `y = x · Wᵀ`.
#[derive(Clone)]
pub struct Linear {
    weight: Stored,
    /// A quantized weight's scales and biases as MLX arrays; `None` where the weight is packed
    /// for the tile unit, which holds them.
    pub scales: Option<Array>,
    pub biases: Option<Array>,
    pub quantization: Option<Quantization>,
}

/// Where a weight lives: MLX's array, or packed for the CPU's tile unit where the kernels take
/// it ([`Packed`]), MLX's copy then dropped.
#[derive(Clone)]
enum Stored {
    Mlx(Array),
    Packed(Arc<Packed>),
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
        Ok(match (load_matrix(w, prefix, out_dims, in_dims, q)?, q) {
            ((weight, Some(scales), Some(biases)), Some(q)) => Linear::quantized(weight, scales, biases, q),
            ((weight, ..), _) => Linear::plain(weight),
        })
    }

    /// A plain weight stored [in, out] and used as x·W (the DSpark format's layout), held as
    /// [out, in] like every other weight, so that its products take the host's loops.
    pub fn from_in_out(w: &Array) -> Result<Linear, Exception> {
        let weight = kernels::row_major(&w.t())?;
        weight.eval()?;
        Ok(Linear::plain(weight))
    }

    /// An unquantized weight [out, in] (or [experts, out, in]), repacked for the tile unit where
    /// it applies: MLX's array is then dropped, and the tiles serve every product.
    pub fn plain(weight: Array) -> Linear {
        Linear { weight: Stored::plain(weight), scales: None, biases: None, quantization: None }
    }

    /// An MLX-quantized weight (packed integers) with its scales and biases, reordered for the
    /// tile unit where it applies: MLX's arrays are then dropped, and the tiles serve every
    /// product.
    pub fn quantized(weight: Array, scales: Array, biases: Array, q: Quantization) -> Linear {
        let (weight, scales, biases) = Stored::quantized(weight, scales, biases, q);
        Linear { weight, scales, biases, quantization: Some(q) }
    }

    /// The weight as an MLX array (packed integers where quantized), rebuilt from the tiles
    /// where only they hold it.
    pub fn weight(&self) -> Array {
        self.weight.array()
    }

    /// Whether the weight is held as tiles for the tile unit.
    pub fn is_tiled(&self) -> bool {
        !matches!(self.weight, Stored::Mlx(_))
    }

    pub fn forward(&self, x: &Array) -> Result<Array, Exception> {
        times_transposed(x, &self.weight, self.scales.as_ref(), self.biases.as_ref(), self.quantization)
    }

    pub fn nbytes(&self) -> usize {
        self.weight.nbytes(self.scales.as_ref(), self.biases.as_ref())
    }
}

impl Stored {
    /// A plain weight, packed for the tile unit where that applies.
    fn plain(weight: Array) -> Stored {
        match Packed::plain(&weight) {
            Some(packed) => Stored::Packed(Arc::new(packed)),
            None => Stored::Mlx(weight),
        }
    }

    /// A quantized weight with its scales and biases: packed, holding them, where that
    /// applies, else MLX's arrays.
    fn quantized(
        weight: Array,
        scales: Array,
        biases: Array,
        q: Quantization,
    ) -> (Stored, Option<Array>, Option<Array>) {
        match Packed::quantized(&weight, &scales, &biases, q) {
            Some(packed) => (Stored::Packed(Arc::new(packed)), None, None),
            None => (Stored::Mlx(weight), Some(scales), Some(biases)),
        }
    }

    fn array(&self) -> Array {
        match self {
            Stored::Mlx(w) => w.clone(),
            Stored::Packed(packed) => packed.array(),
        }
    }

    fn nbytes(&self, scales: Option<&Array>, biases: Option<&Array>) -> usize {
        match self {
            Stored::Mlx(w) => w.nbytes() + scales.map_or(0, Array::nbytes) + biases.map_or(0, Array::nbytes),
            Stored::Packed(packed) => packed.nbytes(),
        }
    }
}

/// A token embedding table [vocab, dims], which can also serve as the tied output head.
#[derive(Clone)]
pub struct Embedding {
    weight: Stored,
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
        Ok(Embedding { weight: Stored::Mlx(weight), scales, biases, quantization: q })
    }

    /// The table as the model's tied head too: a plain bfloat16 or quantized table is repacked
    /// for the tile unit where that applies (see [`Linear::plain`], [`Linear::quantized`]), and
    /// its rows are then read from the tiles, a few bytes per 64-byte line: cheap for the few
    /// rows a step looks up, not for a table whose rows are read by the hundred (the
    /// assistant's centroid head keeps MLX's).
    pub fn tied_head(self) -> Embedding {
        match (self.weight, self.scales, self.biases, self.quantization) {
            (Stored::Mlx(w), None, None, q) => {
                Embedding { weight: Stored::plain(w), scales: None, biases: None, quantization: q }
            }
            (Stored::Mlx(w), Some(s), Some(b), Some(q)) => {
                let (weight, scales, biases) = Stored::quantized(w, s, b, q);
                Embedding { weight, scales, biases, quantization: Some(q) }
            }
            (weight, scales, biases, quantization) => Embedding { weight, scales, biases, quantization },
        }
    }

    /// The table as an MLX array, rebuilt from the tiles where only they hold it.
    pub fn weight(&self) -> Array {
        self.weight.array()
    }

    /// Rows of the table (its vocabulary, or this rank's slice of it).
    pub fn vocab(&self) -> i32 {
        match &self.weight {
            Stored::Mlx(w) => w.shape()[0],
            Stored::Packed(packed) => packed.rows() as i32,
        }
    }

    /// Rows of the table for `ids` (any shape), dequantized when needed.
    pub fn embed(&self, ids: &Array) -> Result<Array, Exception> {
        let weight = match &self.weight {
            Stored::Mlx(w) => w,
            Stored::Packed(packed) => return packed.take_rows(ids),
        };
        if let (Some(scales), Some(biases), Some(q)) = (&self.scales, &self.biases, self.quantization) {
            if let Some(rows) = kernels::dequantized_rows(ids, weight, scales, biases, q)? {
                return Ok(rows);
            }
        }
        let rows = match self.scales {
            None => kernels::layout::take_rows(weight, ids)?,
            Some(_) => weight.take_axis(ids, 0)?,
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
        self.weight.nbytes(self.scales.as_ref(), self.biases.as_ref())
    }

    /// The activation dtype the table produces.
    pub fn dtype(&self) -> Dtype {
        match (&self.weight, &self.scales) {
            (_, Some(scales)) => scales.dtype(),
            (Stored::Mlx(w), None) => w.dtype(),
            (Stored::Packed(_), None) => Dtype::Bfloat16,
        }
    }
}

/// `x · wᵀ` for a plain or quantized w [out, in].
fn times_transposed(
    x: &Array,
    w: &Stored,
    scales: Option<&Array>,
    biases: Option<&Array>,
    q: Option<Quantization>,
) -> Result<Array, Exception> {
    let w = match w {
        Stored::Mlx(w) => w,
        Stored::Packed(packed) => return packed.product(x, q),
    };
    if let Some(y) = kernels::small_product(x, w, scales, biases, q)? {
        return Ok(y);
    }
    if kernels::wide::takes_float32_route(kernels::wide::rows(x), x.dtype(), scales.is_some()) {
        let w = match (scales, q) {
            (Some(scales), Some(q)) => {
                let biases = biases.map(kernels::wide::float32).transpose()?;
                mlx_rs::ops::dequantize(w, kernels::wide::float32(scales)?, biases.as_ref(), q.group_size, q.bits)?
            }
            _ => kernels::wide::float32(w)?,
        };
        return kernels::wide::float32(x)?.matmul(w.t())?.as_dtype(x.dtype());
    }
    match (scales, q) {
        (Some(scales), Some(q)) => mlx_rs::ops::quantized_matmul(x, w, scales, biases, true, q.group_size, q.bits),
        _ => x.matmul(w.t()),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bfloat16_weight_on_the_tile_unit_drops_mlxs_copy_and_gives_it_back() {
        let key = mlx_rs::random::key(3).unwrap();
        let w = mlx_rs::random::normal::<f32>(&[40, 96], None, None, &key).unwrap().as_dtype(Dtype::Bfloat16).unwrap();
        let linear = Linear::plain(w.clone());
        if Packed::plain(&w).is_none() {
            assert!(!linear.is_tiled());
            return;
        }
        assert!(linear.is_tiled());
        assert_eq!(kernels::bits16(&linear.weight()), kernels::bits16(&w));
        // 40 outputs take a whole group of 64 in the tiles.
        assert_eq!(linear.nbytes(), 64 * 96 * 2);
        let x =
            mlx_rs::random::normal::<f32>(&[1, 3, 96], None, None, &key).unwrap().as_dtype(Dtype::Bfloat16).unwrap();
        let ours = linear.forward(&x).unwrap().as_dtype(Dtype::Float32).unwrap();
        let mlx = x.matmul(w.t()).unwrap().as_dtype(Dtype::Float32).unwrap();
        assert_eq!(ours.shape(), &[1, 3, 40]);
        let close = ours.all_close(&mlx, 1e-2, 1e-2, None).unwrap();
        assert!(close, "the tiled product is MLX's, up to bfloat16 rounding");
        let narrow = mlx_rs::Array::ones::<f32>(&[1, 95]).unwrap().as_dtype(Dtype::Bfloat16).unwrap();
        assert!(linear.forward(&narrow).is_err(), "x of another width is MLX's error");
    }

    #[test]
    fn a_quantized_table_on_the_tile_unit_gives_mlxs_rows_weight_and_logits() {
        let key = mlx_rs::random::key(5).unwrap();
        let table =
            mlx_rs::random::normal::<f32>(&[100, 128], None, None, &key).unwrap().as_dtype(Dtype::Bfloat16).unwrap();
        let (wq, scales, biases) = mlx_rs::ops::quantize(&table, 64, 4).unwrap();
        let q = Quantization { group_size: 64, bits: 4 };
        let packs = Packed::quantized(&wq, &scales, &biases, q).is_some();
        let plain = Embedding {
            weight: Stored::Mlx(wq.clone()),
            scales: Some(scales),
            biases: Some(biases),
            quantization: Some(q),
        };
        let head = plain.clone().tied_head();
        if !packs {
            assert!(matches!(head.weight, Stored::Mlx(_)));
            return;
        }
        assert!(matches!(head.weight, Stored::Packed(_)));
        assert_eq!((head.vocab(), head.dtype()), (100, Dtype::Bfloat16));
        assert_eq!(head.weight().as_slice::<u32>(), wq.as_slice::<u32>(), "the packed weight back from the tiles");
        let ids = mlx_rs::Array::from_slice(&[0i32, 99, 17, 17, 64, 3], &[2, 3]);
        let (ours, mlx) = (head.embed(&ids).unwrap(), plain.embed(&ids).unwrap());
        assert_eq!(ours.shape(), &[2, 3, 128]);
        assert_eq!(kernels::bits16(&ours), kernels::bits16(&mlx), "rows dequantized as MLX does");
        let outside = mlx_rs::Array::from_slice(&[100i32], &[1]);
        let error = head.embed(&outside).unwrap_err().to_string();
        assert!(error.contains("token id 100") && error.contains("100 rows"), "{error}");
        let x =
            mlx_rs::random::normal::<f32>(&[1, 3, 128], None, None, &key).unwrap().as_dtype(Dtype::Bfloat16).unwrap();
        let logits = head.as_linear(&x).unwrap().as_dtype(Dtype::Float32).unwrap();
        let mlx = plain.as_linear(&x).unwrap().as_dtype(Dtype::Float32).unwrap();
        assert!(logits.all_close(&mlx, 1e-2, 1e-2, None).unwrap(), "the head's logits are MLX's, up to rounding");
        // Rows the tiles do not take (another width) are MLX's op's, and its error.
        let narrow = mlx_rs::Array::ones::<f32>(&[1, 96]).unwrap().as_dtype(Dtype::Bfloat16).unwrap();
        assert!(head.as_linear(&narrow).is_err());
    }

    #[test]
    fn a_tied_head_on_the_tile_unit_looks_up_its_rows_from_the_tiles() {
        let key = mlx_rs::random::key(4).unwrap();
        let table =
            mlx_rs::random::normal::<f32>(&[100, 64], None, None, &key).unwrap().as_dtype(Dtype::Bfloat16).unwrap();
        let plain = Embedding { weight: Stored::Mlx(table.clone()), scales: None, biases: None, quantization: None };
        let head = plain.clone().tied_head();
        if Packed::plain(&table).is_none() {
            assert!(matches!(head.weight, Stored::Mlx(_)));
            return;
        }
        assert!(matches!(head.weight, Stored::Packed(_)));
        assert_eq!((head.vocab(), head.dtype()), (100, Dtype::Bfloat16));
        assert_eq!(kernels::bits16(&head.weight()), kernels::bits16(&table));
        let ids = mlx_rs::Array::from_slice(&[0i32, 99, 17, 17, 64, 3], &[2, 3]);
        let (ours, mlx) = (head.embed(&ids).unwrap(), plain.embed(&ids).unwrap());
        assert_eq!(ours.shape(), &[2, 3, 64]);
        assert_eq!(kernels::bits16(&ours), kernels::bits16(&mlx));
        let outside = mlx_rs::Array::from_slice(&[5i32, 100], &[2]);
        let error = head.embed(&outside).unwrap_err().to_string();
        assert!(error.contains("token id 100") && error.contains("100 rows"), "{error}");
        let x =
            mlx_rs::random::normal::<f32>(&[1, 2, 64], None, None, &key).unwrap().as_dtype(Dtype::Bfloat16).unwrap();
        let logits = head.as_linear(&x).unwrap().as_dtype(Dtype::Float32).unwrap();
        let mlx = plain.as_linear(&x).unwrap().as_dtype(Dtype::Float32).unwrap();
        assert!(logits.all_close(&mlx, 1e-2, 1e-2, None).unwrap(), "the head's logits are MLX's, up to rounding");
    }
}

#[cfg(test)]
mod float32_route_tests {
    use mlx_rs::random;

    use super::*;
    use kernels::wide::{float32, WIDE_ROWS};

    fn normal(shape: &[i32], seed: u64) -> Array {
        random::normal::<f32>(shape, None, None, &random::key(seed).unwrap()).unwrap()
    }

    /// Largest |a − b| relative to the largest |b|.
    fn relative_difference(a: &Array, b: &Array) -> f32 {
        let (a, b) = (float32(a).unwrap(), float32(b).unwrap());
        let diff = a.subtract(&b).unwrap().abs().unwrap().max(None).unwrap().item_exact::<f32>();
        diff / b.abs().unwrap().max(None).unwrap().item_exact::<f32>()
    }

    #[test]
    fn quantized_products_equal_mlxs_quantized_matmul() {
        for (bits, group_size) in [(4, 32), (4, 64), (8, 64), (8, 128)] {
            let w = normal(&[64, 256], 3);
            let (wq, scales, biases) = mlx_rs::ops::quantize(&w, group_size, bits).unwrap();
            let x = normal(&[WIDE_ROWS + 3, 256], 4);
            let q = Quantization { group_size, bits };
            let linear = Linear::quantized(wq.clone(), scales.clone(), biases.clone(), q);
            let ours = linear.forward(&x).unwrap();
            let mlx = mlx_rs::ops::quantized_matmul(&x, &wq, &scales, &biases, true, group_size, bits).unwrap();
            let d = relative_difference(&ours, &mlx);
            assert!(d <= 1e-5, "{bits} bits, group {group_size}: {d}");
        }
    }
}

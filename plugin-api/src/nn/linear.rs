//! Linear layers and embeddings, plain or MLX-quantized (affine, per-group scales and biases),
//! loaded by tensor name with their shapes checked.

use std::sync::Arc;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use super::kernels::amx_bf16::{self, Tiles};
use super::kernels::amx_quantized::{self, QuantTiles};
use super::kernels::Tiled;
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
    weight: Stored,
    /// A quantized weight's scales and biases as MLX arrays; `None` where the weight is held as
    /// tiles, which hold them.
    pub scales: Option<Array>,
    pub biases: Option<Array>,
    pub quantization: Option<Quantization>,
}

/// Where a weight lives. A plain bfloat16 weight on a CPU whose tile unit this process may use
/// ([`amx_bf16::available`]) is repacked once for the unit, and MLX's copy is dropped: the
/// tiles then serve every product with it ([`kernels::tiled_product`]), whatever its rows'
/// count, so that a row's result does not depend on it, and the weight takes no more memory
/// than as loaded.
///
/// An MLX-quantized weight with bfloat16 scales and biases (as mlx-lm converts bfloat16
/// checkpoints) is reordered for the unit likewise ([`amx_quantized`]), with its scales and
/// biases, at the bytes MLX's arrays took.
#[derive(Clone)]
enum Stored {
    Mlx(Array),
    Tiles(Arc<Tiles>),
    QuantTiles(Arc<QuantTiles>),
}

/// `w` [n, k] repacked for the tile unit, where it is a plain bfloat16 matrix, MLX runs on the
/// CPU and the unit is available.
fn tiles_of(w: &Array) -> Option<Tiles> {
    if w.dtype() != Dtype::Bfloat16 || w.ndim() != 2 || !wide::on_cpu() || !amx_bf16::available() {
        return None;
    }
    let (n, k) = (w.shape()[0] as usize, w.shape()[1] as usize);
    kernels::bits16(w).map(|bits| Tiles::pack(bits, n, k))
}

/// An MLX-quantized `w` [n, k·bits/32] reordered for the tile unit with its bfloat16 scales
/// and biases, where MLX runs on the CPU and the unit is available.
fn quant_tiles_of(w: &Array, scales: &Array, biases: &Array, q: Quantization) -> Option<QuantTiles> {
    let (bits, group) = (q.bits as u32, q.group_size as usize);
    let applies = w.ndim() == 2
        && w.dtype() == Dtype::Uint32
        && scales.dtype() == Dtype::Bfloat16
        && biases.dtype() == Dtype::Bfloat16
        && QuantTiles::takes(bits, group)
        && wide::on_cpu()
        && amx_quantized::available();
    if !applies {
        return None;
    }
    let (n, k) = (w.shape()[0] as usize, w.shape()[1] as usize * 32 / bits as usize);
    let packed = kernels::row_major(w).ok()?;
    let (scales, biases) = (kernels::row_major(scales).ok()?, kernels::row_major(biases).ok()?);
    let packed = packed.try_as_slice::<u32>().ok()?;
    let (scales, biases) = (kernels::bits16(&scales)?, kernels::bits16(&biases)?);
    let fits = k.is_multiple_of(group) && scales.len() == n * (k / group) && biases.len() == scales.len();
    fits.then(|| QuantTiles::pack(packed, scales, biases, n, k, bits, group))
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
    /// A plain weight, repacked for the tile unit where that applies.
    fn plain(weight: Array) -> Stored {
        match tiles_of(&weight) {
            Some(tiles) => Stored::Tiles(Arc::new(tiles)),
            None => Stored::Mlx(weight),
        }
    }

    /// A quantized weight with its scales and biases: as tiles, which hold them, where that
    /// applies, else MLX's arrays.
    fn quantized(
        weight: Array,
        scales: Array,
        biases: Array,
        q: Quantization,
    ) -> (Stored, Option<Array>, Option<Array>) {
        match quant_tiles_of(&weight, &scales, &biases, q) {
            Some(tiles) => (Stored::QuantTiles(Arc::new(tiles)), None, None),
            None => (Stored::Mlx(weight), Some(scales), Some(biases)),
        }
    }

    fn array(&self) -> Array {
        match self {
            Stored::Mlx(w) => w.clone(),
            Stored::Tiles(tiles) => {
                kernels::from_bits16(&tiles.unpack(), &[tiles.n as i32, tiles.k as i32], Dtype::Bfloat16)
            }
            Stored::QuantTiles(tiles) => {
                let words_per_row = tiles.k * tiles.bits as usize / 32;
                Array::from_slice(&tiles.unpack().0, &[tiles.n as i32, words_per_row as i32])
            }
        }
    }

    /// The weight as tiles, where they hold it.
    fn tiled(&self) -> Option<Tiled<'_>> {
        match self {
            Stored::Mlx(_) => None,
            Stored::Tiles(t) => Some(Tiled::Bf16(t)),
            Stored::QuantTiles(t) => Some(Tiled::Quantized(t)),
        }
    }

    fn nbytes(&self, scales: Option<&Array>, biases: Option<&Array>) -> usize {
        match self {
            Stored::Mlx(w) => w.nbytes() + scales.map_or(0, Array::nbytes) + biases.map_or(0, Array::nbytes),
            Stored::Tiles(tiles) => tiles.nbytes(),
            Stored::QuantTiles(tiles) => tiles.nbytes(),
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
            Stored::Tiles(tiles) => tiles.n as i32,
            Stored::QuantTiles(tiles) => tiles.n as i32,
        }
    }

    /// Rows of the table for `ids` (any shape), dequantized when needed.
    pub fn embed(&self, ids: &Array) -> Result<Array, Exception> {
        let weight = match &self.weight {
            Stored::Mlx(w) => w,
            Stored::Tiles(tiles) => return rows_from_tiles(tiles, ids),
            Stored::QuantTiles(tiles) => return rows_from_quant_tiles(tiles, ids),
        };
        if let (Some(scales), Some(biases), Some(q)) = (&self.scales, &self.biases, self.quantization) {
            if let Some(rows) = kernels::dequantized_rows(ids, weight, scales, biases, q)? {
                return Ok(rows);
            }
        }
        let rows = match self.scales {
            None => super::layout::take_rows(weight, ids)?,
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
            (Stored::Tiles(_) | Stored::QuantTiles(_), None) => Dtype::Bfloat16,
        }
    }
}

/// Rows `ids` (int32 or uint32, any shape) of a table held as tiles, as [ids' shape…, dims]
/// bfloat16; an id outside the table is an error that names it.
fn rows_from_tiles(tiles: &Tiles, ids: &Array) -> Result<Array, Exception> {
    let ids = kernels::row_major(ids)?;
    let Some(picked) = kernels::token_ids(&ids) else {
        return Err(Exception::custom(format!("token ids of {:?}, not int32 or uint32", ids.dtype())));
    };
    let mut bits = Vec::with_capacity(picked.len() * tiles.k);
    for &id in &picked {
        if id < 0 || id as usize >= tiles.n {
            return Err(Exception::custom(format!("token id {id} outside the table's {} rows", tiles.n)));
        }
        tiles.row(id as usize, &mut bits);
    }
    let mut shape = ids.shape().to_vec();
    shape.push(tiles.k as i32);
    Ok(kernels::from_bits16(&bits, &shape, Dtype::Bfloat16))
}

/// Rows `ids` of a quantized table held as tiles, dequantized as MLX's `dequantize` does (see
/// [`kernels::dequantized_rows`]), as [ids' shape…, dims] bfloat16; an id outside the table is an
/// error that names it.
fn rows_from_quant_tiles(tiles: &QuantTiles, ids: &Array) -> Result<Array, Exception> {
    let ids = kernels::row_major(ids)?;
    let Some(picked) = kernels::token_ids(&ids) else {
        return Err(Exception::custom(format!("token ids of {:?}, not int32 or uint32", ids.dtype())));
    };
    let mut values = Vec::with_capacity(picked.len() * tiles.k);
    for &id in &picked {
        if id < 0 || id as usize >= tiles.n {
            return Err(Exception::custom(format!("token id {id} outside the table's {} rows", tiles.n)));
        }
        values.extend((0..tiles.k).map(|i| {
            let (q, scale, bias) = tiles.weight_parts(id as usize, i);
            kernels::dequantized(kernels::ToBf16, q, scale, bias)
        }));
    }
    let mut shape = ids.shape().to_vec();
    shape.push(tiles.k as i32);
    Ok(kernels::rounded(&values, &shape, Dtype::Bfloat16))
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
        Stored::Tiles(_) | Stored::QuantTiles(_) => {
            return match kernels::tiled_product(x, w.tiled().expect("held as tiles"))? {
                Some(y) => Ok(y),
                // Rows the tiles do not take (of another width or dtype): MLX's op decides.
                None => match (w, q) {
                    (Stored::QuantTiles(t), Some(q)) => {
                        let (_, s, b) = t.unpack();
                        let params =
                            |p: &[u16]| kernels::from_bits16(p, &[t.n as i32, (t.k / t.group) as i32], Dtype::Bfloat16);
                        mlx_rs::ops::quantized_matmul(x, w.array(), params(&s), &params(&b), true, q.group_size, q.bits)
                    }
                    _ => x.matmul(w.array().t()),
                },
            };
        }
    };
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
        if !(wide::on_cpu() && amx_bf16::available()) {
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
        let q = Some(Quantization { group_size: 64, bits: 4 });
        let plain =
            Embedding { weight: Stored::Mlx(wq.clone()), scales: Some(scales), biases: Some(biases), quantization: q };
        let head = plain.clone().tied_head();
        if !(wide::on_cpu() && amx_quantized::available()) {
            assert!(matches!(head.weight, Stored::Mlx(_)));
            return;
        }
        assert!(matches!(head.weight, Stored::QuantTiles(_)));
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
        if !(wide::on_cpu() && amx_bf16::available()) {
            assert!(matches!(head.weight, Stored::Mlx(_)));
            return;
        }
        assert!(matches!(head.weight, Stored::Tiles(_)));
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

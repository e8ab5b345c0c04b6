//! Rotary position embeddings over host arrays: MLX's CPU rope in one pass, bit for bit.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::arrays::{
    avx2_where_available, bits16, from_bits16, rounded, row_major, with_floats, with_round, Round, ToBf16, Value,
};

/// Rotates x [B, H, L, D] whose row b starts at position `offsets[b]`, the first `dims` of each
/// vector, where the CPU route covers it; `None` for MLX's op. `kind` identifies the rope's
/// cosines and sines, and `mlx_rope` is MLX's own rope from position 0, of which they are read.
///
/// MLX's CPU rope (its fallback in mlx/fast.cpp, some twenty ops per call) in one pass:
/// x₁·cos − x₂·sin and x₁·sin + x₂·cos, each product and sum rounded to x's dtype, with the
/// cosines and sines MLX itself computes (see `Table`). Bit for bit MLX's (tested); each
/// MLX op costs microseconds of dispatch on the CPU, and a layer rotates twice.
pub fn rotate(
    x: &Array,
    offsets: &[i32],
    dims: usize,
    kind: impl FnOnce() -> Result<Vec<u32>, Exception>,
    mlx_rope: impl Fn(&Array) -> Result<Array, Exception>,
) -> Result<Option<Array>, Exception> {
    if !crate::route::on_cpu() {
        return Ok(None);
    }
    let dtype = x.dtype();
    let shape = x.shape().to_vec();
    if !matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        || shape.len() != 4
        || offsets.len() != shape[0] as usize
        || offsets.iter().any(|&o| o < 0)
        || dims > shape[3] as usize
    {
        return Ok(None);
    }
    let (heads, length, d) = (shape[1] as usize, shape[2] as usize, shape[3] as usize);
    let end = offsets.iter().map(|&o| o as usize + length).max().unwrap_or(0);
    let table = table(kind()?, dims, dtype, end, mlx_rope)?;
    let x = row_major(x)?;
    let vectors = Vectors { heads, length, d, dims, offsets };
    if dtype == Dtype::Bfloat16 {
        // Read and written as bit patterns, with no float32 copies.
        let bits = bits16(&x).ok_or_else(|| Exception::custom("bfloat16 data"))?;
        let mut y = bits.to_vec();
        rotated_bf16(bits, &table, vectors, &mut y);
        return Ok(Some(from_bits16(&y, &shape, dtype)));
    }
    let y = with_floats(&x, |xs| {
        let mut y = xs.to_vec();
        rotated_floats(dtype, xs, &table, vectors, &mut y);
        rounded(&y, &shape, dtype)
    })?;
    Ok(Some(y))
}

/// The cosines and sines of positions 0..`end` (at least), in `dtype`, shared by every rope
/// of the same kind in the process and grown as positions reach further.
fn table(
    kind: Vec<u32>,
    dims: usize,
    dtype: Dtype,
    end: usize,
    mlx_rope: impl Fn(&Array) -> Result<Array, Exception>,
) -> Result<Arc<Table>, Exception> {
    static TABLES: Mutex<Option<HashMap<TableKey, Arc<Table>>>> = Mutex::new(None);
    let mut tables = TABLES.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let tables = tables.get_or_insert_with(HashMap::new);
    let key = (kind, dtype);
    if let Some(table) = tables.get(&key).filter(|t| t.positions >= end) {
        return Ok(table.clone());
    }
    let positions = end.next_multiple_of(1024).max(tables.get(&key).map_or(0, |t| 2 * t.positions));
    let table = Arc::new(Table::of(dims, dtype, positions, mlx_rope)?);
    tables.insert(key, table.clone());
    Ok(table)
}

/// How x [B, H, L, D] is laid out: each of its vectors of `d` has its first `dims` rotated, at
/// position `offsets[b] + l`.
#[derive(Clone, Copy)]
struct Vectors<'a> {
    heads: usize,
    length: usize,
    d: usize,
    dims: usize,
    offsets: &'a [i32],
}

avx2_where_available! {
    /// Every vector of `xs` rotated into `out` (which holds a copy of `xs`), rounded to `dtype`.
    fn rotated_floats(dtype: Dtype, xs: &[f32], table: &Table, v: Vectors, out: &mut [f32]) {
        with_round!(dtype, |r| rotated_vectors(r, xs, table, v, out));
    }
}

avx2_where_available! {
    /// [`rotated_floats`] of bfloat16 bit patterns.
    fn rotated_bf16(xs: &[u16], table: &Table, v: Vectors, out: &mut [u16]) {
        rotated_vectors(ToBf16, xs, table, v, out);
    }
}

/// Every vector of `xs` rotated into `out`, each product and sum rounded by `r`. Compiled with
/// AVX2 or AVX-512 (above), the loop is vector code rather than one element at a time.
#[inline(always)]
fn rotated_vectors<T: Value>(r: impl Round, xs: &[T], table: &Table, v: Vectors, out: &mut [T]) {
    let half = v.dims / 2;
    for (i, (x, out)) in xs.chunks(v.d).zip(out.chunks_mut(v.d)).enumerate() {
        let (b, l) = (i / (v.heads * v.length), i % v.length);
        let position = v.offsets[b] as usize + l;
        let (cos, sin) = (&table.cos[position * half..][..half], &table.sin[position * half..][..half]);
        rotated(r, &x[..v.dims], cos, sin, &mut out[..v.dims]);
    }
}

/// One head of one position rotated: x₁·cos − x₂·sin and x₁·sin + x₂·cos over the two halves
/// of `x`, each product and sum rounded by `r`.
#[inline(always)]
fn rotated<T: Value>(r: impl Round, x: &[T], cos: &[f32], sin: &[f32], out: &mut [T]) {
    let half = cos.len();
    let (x1, x2) = x.split_at(half);
    let (out1, out2) = out.split_at_mut(half);
    // Zipped, with no index to check, the loop compiles to vector code.
    let rows = out1.iter_mut().zip(out2.iter_mut()).zip(x1.iter().zip(x2)).zip(cos.iter().zip(sin));
    for (((y1, y2), (&x1, &x2)), (&cos, &sin)) in rows {
        let (x1, x2) = (x1.as_f32(), x2.as_f32());
        *y1 = T::from_f32(r.round(r.round(x1 * cos) - r.round(x2 * sin)));
        *y2 = T::from_f32(r.round(r.round(x1 * sin) + r.round(x2 * cos)));
    }
}

/// A rope's kind (dims and base, or dims and frequencies, as bits) and the dtype.
type TableKey = (Vec<u32>, Dtype);

/// cos θ and sin θ for every position and frequency, [positions, dims / 2] each, as MLX's rope
/// rounds them to the activation dtype.
struct Table {
    positions: usize,
    cos: Vec<f32>,
    sin: Vec<f32>,
}

impl Table {
    /// Read off MLX's own rope: rotating x₁ = 1, x₂ = 0 gives cos θ in the first half and sin θ
    /// in the second, exactly (a product by one or zero rounds to itself).
    fn of(
        dims: usize,
        dtype: Dtype,
        positions: usize,
        mlx_rope: impl Fn(&Array) -> Result<Array, Exception>,
    ) -> Result<Table, Exception> {
        let half = dims / 2;
        let probe: Vec<f32> =
            (0..positions).flat_map(|_| (0..dims).map(|j| if j < half { 1.0 } else { 0.0 })).collect();
        let probe = Array::from_slice(&probe, &[1, 1, positions as i32, dims as i32]).as_dtype(dtype)?;
        let rotated = row_major(&mlx_rope(&probe)?)?;
        with_floats(&rotated, |r| {
            let (mut cos, mut sin) = (Vec::with_capacity(positions * half), Vec::with_capacity(positions * half));
            for v in r.chunks(dims) {
                cos.extend_from_slice(&v[..half]);
                sin.extend_from_slice(&v[half..]);
            }
            Table { positions, cos, sin }
        })
    }
}

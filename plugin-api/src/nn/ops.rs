//! Small functional pieces, each as mlx-lm computes it.

use mlx_rs::error::Exception;
use mlx_rs::fast::ScaledDotProductAttentionMask;
use mlx_rs::{Array, Dtype};

use super::kernels::{bits16, round_to, rounded, row_major, with_floats, with_round, Round, Value};

/// RMSNorm with a weight (multiplied as is, not 1 + w) or without one.
pub fn rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Array, Exception> {
    if super::wide::on_cpu() {
        if let Some(y) = cpu_rms_norm(x, weight, eps)? {
            return Ok(y);
        }
    }
    mlx_rs::fast::rms_norm(x, weight, eps)
}

/// RMSNorm on the CPU as MLX computes it there (its fallback in mlx/fast.cpp, seven ops): in
/// float32, the squares summed in order, times 1/n, plus eps, 1/√, times x; rounded to x's
/// dtype; times the weight, rounded again. Done here in one pass because each MLX op costs
/// microseconds of dispatch on the CPU and a small model meets eight norms per layer; the
/// result is MLX's bit for bit (tested). `None` for what it does not cover.
fn cpu_rms_norm(x: &Array, weight: Option<&Array>, eps: f32) -> Result<Option<Array>, Exception> {
    use super::kernels::{rounded, with_floats, with_round};
    let dtype = x.dtype();
    let n = x.shape().last().copied().unwrap_or(0) as usize;
    let weight_fits = weight.is_none_or(|w| w.dtype() == dtype && w.shape() == [n as i32]);
    if !matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16) || n == 0 || !weight_fits {
        return Ok(None);
    }
    let x = row_major(x)?;
    if dtype == Dtype::Bfloat16 {
        // Read and written as bit patterns, with no float32 copy of x or of the weight.
        let weight = weight.map(row_major).transpose()?;
        let weight =
            weight.as_ref().map(|w| bits16(w).ok_or_else(|| Exception::custom("bfloat16 weight"))).transpose()?;
        let bits = bits16(&x).ok_or_else(|| Exception::custom("bfloat16 data"))?;
        let scales = row_scales(bits, n, eps);
        let mut y = vec![0u16; bits.len()];
        for ((row, out), &scale) in bits.chunks(n).zip(y.chunks_mut(n)).zip(&scales) {
            normalized_bf16(row, scale, weight, out);
        }
        return Ok(Some(super::kernels::from_bits16(&y, x.shape(), dtype)));
    }
    let weight = weight.map(|w| row_major(w).and_then(|w| with_floats(&w, <[f32]>::to_vec))).transpose()?;
    let y = with_floats(&x, |xs| {
        let scales = row_scales(xs, n, eps);
        let mut y = vec![0f32; xs.len()];
        for ((row, out), &scale) in xs.chunks(n).zip(y.chunks_mut(n)).zip(&scales) {
            with_round!(dtype, |r| normalized(r, row, scale, weight.as_deref(), out));
        }
        rounded(&y, x.shape(), dtype)
    })?;
    Ok(Some(y))
}

super::kernels::avx2_where_available! {
    /// [`normalized`] for bfloat16, read and written as bit patterns.
    fn normalized_bf16(row: &[u16], scale: f32, weight: Option<&[u16]>, out: &mut [u16]) {
        use super::kernels::{bf16_bits, ToBf16};
        match weight {
            Some(w) => {
                for ((y, &v), &w) in out.iter_mut().zip(row).zip(w) {
                    *y = bf16_bits(ToBf16.round(v.as_f32() * scale) * w.as_f32());
                }
            }
            None => {
                for (y, &v) in out.iter_mut().zip(row) {
                    *y = bf16_bits(v.as_f32() * scale);
                }
            }
        }
    }
}

/// Each row's 1/√(mean of squares + eps), the rows `n` long: what its values are multiplied by.
fn row_scales<T: Value>(xs: &[T], n: usize, eps: f32) -> Vec<f32> {
    let inverse_n = (1.0 / n as f64) as f32;
    let sums = xs.chunks(SUMMED_TOGETHER * n).flat_map(|rows| squares_summed_in_order(rows, n));
    sums.map(|sum| 1.0 / (sum * inverse_n + eps).sqrt()).collect()
}

/// Rows whose sums of squares [`squares_summed_in_order`] takes side by side.
const SUMMED_TOGETHER: usize = 8;

/// The sum of squares of each row of `rows` (at most [`SUMMED_TOGETHER`] rows of `n`), each in
/// element order as MLX sums it. One row's sum is a chain of dependent additions, bound by
/// their latency; several rows' chains advance together, and a batch's norms take little more
/// time than one row's.
fn squares_summed_in_order<T: Value>(rows: &[T], n: usize) -> impl Iterator<Item = f32> {
    let mut sums = [0f32; SUMMED_TOGETHER];
    // The row count is a constant in each arm, so that the sums stay in registers.
    match rows.len() / n {
        1 => squares_of::<1, T>(rows, n, &mut sums),
        2 => squares_of::<2, T>(rows, n, &mut sums),
        3 => squares_of::<3, T>(rows, n, &mut sums),
        4 => squares_of::<4, T>(rows, n, &mut sums),
        5 => squares_of::<5, T>(rows, n, &mut sums),
        6 => squares_of::<6, T>(rows, n, &mut sums),
        7 => squares_of::<7, T>(rows, n, &mut sums),
        _ => squares_of::<8, T>(rows, n, &mut sums),
    }
    sums.into_iter().take(rows.len() / n)
}

/// [`squares_summed_in_order`] of `R` rows, into `out`'s first `R`.
#[inline(always)]
fn squares_of<const R: usize, T: Value>(rows: &[T], n: usize, out: &mut [f32; SUMMED_TOGETHER]) {
    let rows: [&[T]; R] = std::array::from_fn(|r| &rows[r * n..][..n]);
    let mut sums = [0f32; R];
    // Element i of every row, then i + 1: the rows' chains advance together.
    #[allow(clippy::needless_range_loop)]
    for i in 0..n {
        for r in 0..R {
            let v = rows[r][i].as_f32();
            sums[r] += v * v;
        }
    }
    out[..R].copy_from_slice(&sums);
}

/// One row of [`cpu_rms_norm`] after its sum: x times the scale, rounded, times the weight,
/// rounded again.
#[inline(always)]
fn normalized(r: impl Round, row: &[f32], scale: f32, weight: Option<&[f32]>, out: &mut [f32]) {
    match weight {
        Some(w) => {
            for ((y, &v), &w) in out.iter_mut().zip(row).zip(w) {
                *y = r.round(r.round(v * scale) * w);
            }
        }
        None => {
            for (y, &v) in out.iter_mut().zip(row) {
                *y = r.round(v * scale);
            }
        }
    }
}

/// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`, mlx's `gelu_approx`.
pub fn gelu_approx(x: &Array) -> Result<Array, Exception> {
    let dtype = x.dtype();
    let c = scalar(0.044715, dtype)?;
    let k = scalar((2.0 / std::f32::consts::PI).sqrt(), dtype)?;
    // x³ as one power (rounded once), like mlx's `x ** 3`, not two products.
    let cube = x.power(scalar(3.0, dtype)?)?;
    let inner = x.add(cube.multiply(&c)?)?.multiply(&k)?;
    let gate = mlx_rs::ops::tanh(&inner)?.add(scalar(1.0, dtype)?)?;
    x.multiply(scalar(0.5, dtype)?)?.multiply(&gate)
}

/// GeGLU: `gelu_approx(gate) ⊙ up`.
pub fn geglu(gate: &Array, up: &Array) -> Result<Array, Exception> {
    if super::wide::on_cpu() {
        if let Some(y) = cpu_geglu(gate, up)? {
            return Ok(y);
        }
    }
    gelu_approx(gate)?.multiply(up)
}

/// SwiGLU: `silu(gate) ⊙ up`, silu being `gate · sigmoid(gate)` (Qwen's MLP, as mlx-lm writes
/// it).
pub fn swiglu(gate: &Array, up: &Array) -> Result<Array, Exception> {
    if super::wide::on_cpu() {
        if let Some(y) = cpu_swiglu(gate, up)? {
            return Ok(y);
        }
    }
    gate.multiply(mlx_rs::ops::sigmoid(gate)?)?.multiply(up)
}

/// [`swiglu`]'s three MLX ops in one pass for half-precision values: silu read from a table of
/// MLX's own results at every value of the dtype (so its exponential and roundings are MLX's),
/// times up, rounded. `None` for other dtypes or shapes.
fn cpu_swiglu(gate: &Array, up: &Array) -> Result<Option<Array>, Exception> {
    let dtype = gate.dtype();
    if up.dtype() != dtype || up.shape() != gate.shape() {
        return Ok(None);
    }
    let Some(table) = half_table_of_mlx(dtype, "silu", |x| x.multiply(mlx_rs::ops::sigmoid(x)?))? else {
        return Ok(None);
    };
    times_looked_up(table, gate, up).map(Some)
}

/// `table[gate] · up` for half-precision arrays of one shape and dtype, each product rounded
/// to the dtype: the last step of GeGLU and SwiGLU once their activation is a table lookup
/// ([`half_table`]). Read and written as bit patterns, a table index being one.
fn times_looked_up(table: &[f32], gate: &Array, up: &Array) -> Result<Array, Exception> {
    use super::kernels::{bits16, from_bits16, row_major};
    let (gate, up) = (row_major(gate)?, row_major(up)?);
    let (Some(gates), Some(ups)) = (bits16(&gate), bits16(&up)) else {
        return Err(Exception::custom("half-precision gate and up"));
    };
    let mut y = vec![0u16; gates.len()];
    match gate.dtype() {
        Dtype::Bfloat16 => times_looked_up_bf16(table, gates, ups, &mut y),
        _ => {
            for ((y, &g), &u) in y.iter_mut().zip(gates).zip(ups) {
                *y = half::f16::from_f32(table[g as usize] * half::f16::from_bits(u).to_f32()).to_bits();
            }
        }
    }
    Ok(from_bits16(&y, gate.shape(), gate.dtype()))
}

super::kernels::avx2_where_available! {
    /// [`times_looked_up`] for bfloat16.
    fn times_looked_up_bf16(table: &[f32], gates: &[u16], ups: &[u16], y: &mut [u16]) {
        let table: &[f32; 1 << 16] = table.try_into().expect("a table of every 16-bit pattern");
        for ((y, &g), &u) in y.iter_mut().zip(gates).zip(ups) {
            *y = super::kernels::bf16_bits(table[g as usize] * f32::from_bits((u as u32) << 16));
        }
    }
}

/// [`geglu`]'s nine MLX ops in one pass, each step rounded to the dtype as MLX rounds it, with
/// the C library's `powf` and `tanhf` that MLX's CPU ops call: MLX's result bit for bit
/// (tested), without nine dispatches of microseconds each. `None` for what it does not cover.
fn cpu_geglu(gate: &Array, up: &Array) -> Result<Option<Array>, Exception> {
    use super::kernels::{rounded, row_major, with_floats};
    let dtype = gate.dtype();
    if !matches!(dtype, Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        || up.dtype() != dtype
        || up.shape() != gate.shape()
    {
        return Ok(None);
    }
    if let Some(table) = half_gelu_table(dtype) {
        return times_looked_up(table, gate, up).map(Some);
    }
    // Float32: MLX's steps in vector code (`x · x · x` for its `powf`, and `nn::tanh`), within
    // a few units in the last place of MLX's result.
    let (gate, up) = (row_major(gate)?, row_major(up)?);
    let ups = with_floats(&up, <[f32]>::to_vec)?;
    let y = with_floats(&gate, |xs| {
        let gelu = super::tanh::map(xs, gelu_float32);
        let y: Vec<f32> = gelu.iter().zip(&ups).map(|(&g, &u)| g * u).collect();
        rounded(&y, gate.shape(), dtype)
    })?;
    Ok(Some(y))
}

/// gelu_tanh(x) in float32, by MLX's steps.
#[inline(always)]
fn gelu_float32(x: f32) -> f32 {
    const C: f32 = 0.044715;
    let k = (2.0 / std::f32::consts::PI).sqrt();
    let inner = (x + x * x * x * C) * k;
    x * 0.5 * (super::tanh::tanh(inner) + 1.0)
}

/// gelu_tanh(x) as MLX's ops compute it in `dtype`, every step rounded.
fn gelu(dtype: Dtype, x: f32) -> f32 {
    let round = |v| super::kernels::round_to(dtype, v);
    let (c, k) = (round(0.044715), round((2.0 / std::f32::consts::PI).sqrt()));
    let inner = round(round(x + round(round(x.powf(3.0)) * c)) * k);
    let g = round(round(inner.tanh()) + 1.0);
    round(round(x * 0.5) * g)
}

/// `f` at each of the 65,536 values of a half-precision `dtype`, indexed by bit pattern: an
/// elementwise op whose input is a half-precision value depends on that value alone, so a table
/// computed once by the op's own steps gives the same bits at the cost of a lookup. One table
/// per op (`what` and its `param`) and dtype, kept for the life of the process; `None` for
/// other dtypes.
fn half_table(dtype: Dtype, what: &'static str, param: f32, f: impl Fn(f32) -> f32) -> Option<&'static [f32]> {
    half_table_made(dtype, what, param, |widen| Ok((0..=u16::MAX).map(|b| f(widen(b))).collect())).ok().flatten()
}

/// [`half_table`] made whole by `make` (given the dtype's widening of a bit pattern), the first
/// time it is asked for.
fn half_table_made(
    dtype: Dtype,
    what: &'static str,
    param: f32,
    make: impl FnOnce(fn(u16) -> f32) -> Result<Vec<f32>, Exception>,
) -> Result<Option<&'static [f32]>, Exception> {
    type Key = (&'static str, bool, u32);
    static TABLES: std::sync::Mutex<Vec<(Key, &'static [f32])>> = std::sync::Mutex::new(Vec::new());
    let widen: fn(u16) -> f32 = match dtype {
        Dtype::Bfloat16 => |b| f32::from_bits((b as u32) << 16),
        Dtype::Float16 => |b| half::f16::from_bits(b).to_f32(),
        _ => return Ok(None),
    };
    let key = (what, dtype == Dtype::Bfloat16, param.to_bits());
    let mut tables = TABLES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, table)) = tables.iter().find(|(k, _)| *k == key) {
        return Ok(Some(table));
    }
    let table: &'static [f32] = Box::leak(make(widen)?.into_boxed_slice());
    tables.push((key, table));
    Ok(Some(table))
}

/// [`half_table`] of an elementwise MLX op, run once over every value of the dtype: its results
/// are the op's own, whatever its arithmetic.
fn half_table_of_mlx(
    dtype: Dtype,
    what: &'static str,
    op: impl Fn(&Array) -> Result<Array, Exception>,
) -> Result<Option<&'static [f32]>, Exception> {
    half_table_made(dtype, what, 0.0, |_| {
        let every = match dtype {
            Dtype::Bfloat16 => {
                Array::from_slice(&(0..=u16::MAX).map(half::bf16::from_bits).collect::<Vec<_>>(), &[1 << 16])
            }
            _ => Array::from_slice(&(0..=u16::MAX).map(half::f16::from_bits).collect::<Vec<_>>(), &[1 << 16]),
        };
        super::kernels::with_floats(&op(&every)?, <[f32]>::to_vec)
    })
}

/// gelu's table: a lookup instead of a `powf` and a `tanhf` per element (15% of a batched
/// verify round of the demo target).
fn half_gelu_table(dtype: Dtype) -> Option<&'static [f32]> {
    half_table(dtype, "gelu", 0.0, |x| gelu(dtype, x))
}

/// `tanh(x / cap) · cap`.
pub fn softcap(x: &Array, cap: f32) -> Result<Array, Exception> {
    if super::wide::on_cpu() {
        if let Some(table) = half_softcap_table(x.dtype(), cap) {
            // Bit pattern to bit pattern: the table's values are the dtype's own.
            let x = super::kernels::row_major(x)?;
            let bits = super::kernels::bits16(&x).ok_or_else(|| Exception::custom("half-precision logits"))?;
            let capped: Vec<u16> = match x.dtype() {
                Dtype::Bfloat16 => bits.iter().map(|&b| (table[b as usize].to_bits() >> 16) as u16).collect(),
                _ => bits.iter().map(|&b| half::f16::from_f32(table[b as usize]).to_bits()).collect(),
            };
            return Ok(super::kernels::from_bits16(&capped, x.shape(), x.dtype()));
        }
        if x.dtype() == Dtype::Float32 {
            // MLX's three steps, its `tanhf` replaced by vector code (see `nn::tanh`).
            let x = super::kernels::row_major(x)?;
            let y = super::tanh::map(x.as_slice::<f32>(), |v| super::tanh::tanh(v / cap) * cap);
            return Ok(Array::from_slice(&y, x.shape()));
        }
    }
    let c = scalar(cap, x.dtype())?;
    mlx_rs::ops::tanh(x.divide(&c)?)?.multiply(&c)
}

/// The softcap's table, by MLX's three steps (divide, the C library's `tanhf`, multiply), each
/// rounded to the dtype: a lookup per logit instead of three MLX ops over the vocabulary.
fn half_softcap_table(dtype: Dtype, cap: f32) -> Option<&'static [f32]> {
    let round = |v| super::kernels::round_to(dtype, v);
    let c = round(cap);
    half_table(dtype, "softcap", cap, |x| round(round(round(x / c).tanh()) * c))
}

/// A scalar in `dtype`, so that it does not promote the array it meets (Python floats are
/// weakly typed in MLX; a Rust f32 array is not).
///
/// Made as data, rounded to nearest even as MLX's conversion rounds, rather than by converting
/// a float32 array: every MLX op costs microseconds of dispatch on the CPU, and small models
/// meet scalars several times per layer.
pub fn scalar(value: f32, dtype: Dtype) -> Result<Array, Exception> {
    match dtype {
        Dtype::Float32 => Ok(Array::from_f32(value)),
        Dtype::Bfloat16 => Ok(Array::from_slice(&[half::bf16::from_f32(value)], &[])),
        Dtype::Float16 => Ok(Array::from_slice(&[half::f16::from_f32(value)], &[])),
        _ => Array::from_f32(value).as_dtype(dtype),
    }
}

/// Which keys each query of an attention may read.
#[derive(Clone)]
pub enum Mask {
    /// Every key.
    All,
    /// The L queries are the last L positions of the S keys, each reading itself and before.
    Causal,
    /// Boolean, broadcastable to [B, Hq, L, S]; true = attend.
    Array(Array),
}

/// Attention of queries [B, Hq, L, D] over keys/values [B, Hkv, S, D].
pub fn attention(q: &Array, k: &Array, v: &Array, scale: f32, mask: &Mask) -> Result<Array, Exception> {
    attention_over_slots(q, k, v, k.shape().get(2).map_or(0, |&s| s as usize), scale, mask)
}

/// [`attention`] over the first `slots` slots of keys/values [B, Hkv, S, D]: a KV cache's
/// storage, of which only those are written. The host's loops read them where they lie; the
/// slice MLX would need to cut them is an op, and each op waits on MLX's thread (four per
/// decode step of the demo target, about a tenth of it).
pub fn attention_over_slots(
    q: &Array,
    k: &Array,
    v: &Array,
    slots: usize,
    scale: f32,
    mask: &Mask,
) -> Result<Array, Exception> {
    if matches!(q.dtype(), Dtype::Bfloat16 | Dtype::Float16) && super::wide::on_cpu() {
        if let Some(out) = half_attention(q, k, v, slots, scale, mask)? {
            return Ok(out);
        }
    }
    let (k, v) = (super::layout::first_slots(k, slots)?, super::layout::first_slots(v, slots)?);
    let (k, v) = (&k, &v);
    let mask = match mask {
        Mask::All => None,
        Mask::Causal => Some(ScaledDotProductAttentionMask::Causal),
        Mask::Array(m) => Some(ScaledDotProductAttentionMask::Array(m)),
    };
    mlx_rs::fast::scaled_dot_product_attention(q, k, v, scale, mask, None)
}

/// One row's keys and values for [`attention_rows`]: pieces laid end to end along the key axis,
/// and which keys the row's queries read (broadcastable to [1, Hq, L, S_row]).
pub struct RowKeys<'a> {
    pub pieces: Vec<KeyPiece<'a>>,
    pub mask: Mask,
}

/// Row `row` of keys and values [B, Hkv, S, D].
#[derive(Clone, Copy)]
pub struct KeyPiece<'a> {
    pub keys: &'a Array,
    pub values: &'a Array,
    pub row: usize,
}

/// Attention of row b of queries q [B, Hq, L, D] over row b's own keys and values, for rows
/// whose key counts differ (a drafter's per-row contexts): each row gets, bit for bit, what
/// [`attention`] gives it alone, in one call rather than one per row.
pub fn attention_rows(q: &Array, rows: &[RowKeys], scale: f32) -> Result<Array, Exception> {
    if matches!(q.dtype(), Dtype::Bfloat16 | Dtype::Float16) && super::wide::on_cpu() {
        if let Some(out) = half_attention_rows(q, rows, scale)? {
            return Ok(out);
        }
    }
    let take = |a: &Array, r: usize| a.take_axis(Array::from_slice(&[r as i32], &[1]), 0);
    let outs = rows
        .iter()
        .enumerate()
        .map(|(b, row)| {
            let keys = row.pieces.iter().map(|p| take(p.keys, p.row)).collect::<Result<Vec<_>, _>>()?;
            let values = row.pieces.iter().map(|p| take(p.values, p.row)).collect::<Result<Vec<_>, _>>()?;
            let (keys, values) = (mlx_rs::ops::concatenate(&keys, 2)?, mlx_rs::ops::concatenate(&values, 2)?);
            attention(&take(q, b)?, &keys, &values, scale, &row.mask)
        })
        .collect::<Result<Vec<_>, Exception>>()?;
    mlx_rs::ops::concatenate(&outs, 0)
}

/// MLX's CPU attention in half precision (its fallback in mlx/fast.cpp: scale q, q·kᵀ, mask with
/// the dtype's lowest value, precise softmax, ·v, every step rounded to the dtype), with the two
/// products through the host's loops instead of MLX's generic kernel: the same roundings, the
/// sums in another order, several times faster, and a query's result independent of how many
/// queries share the call, over the first `s` slots of k and v. `None` where the loops do not
/// apply.
///
/// The products read the arrays' data per head directly rather than slicing them with MLX ops:
/// a decode step of a small model is bound by the count of MLX ops, each costing microseconds
/// of dispatch on the CPU.
fn half_attention(
    q: &Array,
    k: &Array,
    v: &Array,
    s: usize,
    scale: f32,
    mask: &Mask,
) -> Result<Option<Array>, Exception> {
    let dtype = q.dtype();
    let ks = k.shape().to_vec();
    if ks.len() != 4 || q.ndim() != 4 {
        return Ok(None);
    }
    let (b, hkv) = (q.shape()[0], ks[1]);
    if ks[0] != b
        || hkv == 0
        || q.shape()[1] % hkv != 0
        || k.dtype() != dtype
        || v.dtype() != dtype
        || v.shape() != ks
        || s > ks[2] as usize
    {
        return Ok(None);
    }
    // A KV cache's storage, or a view of its first slots (see `layout::first_slots`), is read
    // in place, each head's slots being contiguous, rather than copied out first.
    let (k, v) = (InPlace::of(k)?, InPlace::of(v)?);
    let (keys, values) = (k.data(), v.data());
    let rows: Vec<RowData> = (0..b as usize)
        .map(|r| RowData {
            keys: &keys[r * k.row..],
            values: &values[r * v.row..],
            key_heads: k.head,
            value_heads: v.head,
            s,
        })
        .collect();
    half_attention_core(q, &rows, hkv as usize, scale, Masks::Shared(mask)).map(Some)
}

/// A half-precision [B, H, S, D] array (evaluated) whose slots are each D contiguous values and
/// whose heads each hold their S slots in a run (row-major, or a slice of a row-major array
/// along S, as a KV cache's first slots are), with its strides (in elements) of a row and of a
/// head.
struct InPlace {
    array: Array,
    row: usize,
    head: usize,
}

impl InPlace {
    /// `a` itself when so laid out, else a row-major copy.
    fn of(a: &Array) -> Result<InPlace, Exception> {
        a.eval()?;
        let shape = a.shape();
        let [h, s, d] = [1, 2, 3].map(|i| shape[i] as usize);
        // SAFETY: `a` is evaluated and four-dimensional; MLX holds one stride per dimension.
        let strides = unsafe { std::slice::from_raw_parts(mlx_sys::mlx_array_strides(a.as_ptr()), 4) };
        let [row, head, slot, one] = [strides[0], strides[1], strides[2], strides[3]];
        if one == 1 && slot == d && head >= s * d && row >= h * head && a.size() > 0 {
            return Ok(InPlace { array: a.clone(), row, head });
        }
        Ok(InPlace { array: row_major(a)?, row: h * s * d, head: s * d })
    }

    /// The 16-bit data from the first element to the last.
    fn data(&self) -> &[u16] {
        let shape = self.array.shape();
        let [b, h, s, d] = [0, 1, 2, 3].map(|i| shape[i] as usize);
        if b * h * s * d == 0 {
            return &[];
        }
        let span = (b - 1) * self.row + (h - 1) * self.head + s * d;
        // SAFETY: the array is evaluated and 16-bit; its last element lies `span − 1` elements
        // after its first, within its buffer, which it keeps alive while the slice borrows it.
        unsafe { std::slice::from_raw_parts(mlx_sys::mlx_array_data_uint16(self.array.as_ptr()), span) }
    }
}

/// A row's keys and values for [`half_attention_rows`]: one piece read where it lies (row r of
/// it), or several copied end to end per KV head, with their count of keys.
enum Held {
    InPlace(InPlace, InPlace, usize),
    Gathered(Vec<u16>, Vec<u16>, usize),
}

/// [`attention_rows`] through the host's loops: a row of one piece read in place (a drafter's
/// context with its block in the free slots, `LayerContext::with_block`), a row of several
/// pieces copied end to end per KV head; then [`half_attention_core`]. `None` where the loops do
/// not apply.
fn half_attention_rows(q: &Array, rows: &[RowKeys], scale: f32) -> Result<Option<Array>, Exception> {
    let dtype = q.dtype();
    let (hq, d) = (q.shape()[1], q.shape()[3]);
    let Some(first) = rows.first().and_then(|r| r.pieces.first()) else { return Ok(None) };
    let hkv = first.keys.shape()[1];
    let fits = |p: &KeyPiece| {
        let ks = p.keys.shape();
        p.keys.dtype() == dtype
            && p.values.dtype() == dtype
            && p.values.shape() == ks
            && ks.len() == 4
            && ks[1] == hkv
            && ks[3] == d
            && (p.row as i32) < ks[0]
    };
    let all_fit = rows.iter().flat_map(|r| &r.pieces).all(fits);
    if hkv == 0 || hq % hkv != 0 || rows.len() != q.shape()[0] as usize || !all_fit {
        return Ok(None);
    }
    let (hkv, d) = (hkv as usize, d as usize);
    let mut held: Vec<Held> = Vec::with_capacity(rows.len());
    for row in rows {
        if let [piece] = row.pieces.as_slice() {
            held.push(Held::InPlace(InPlace::of(piece.keys)?, InPlace::of(piece.values)?, piece.row));
            continue;
        }
        // Each row's keys and values as [Hkv, S_row, D]; head g of a piece's row r starts at
        // ((r·Hkv + g)·S_piece)·D.
        let pieces: Vec<(Array, Array, usize)> = row
            .pieces
            .iter()
            .map(|p| Ok((row_major(p.keys)?, row_major(p.values)?, p.row)))
            .collect::<Result<_, Exception>>()?;
        let s: usize = pieces.iter().map(|(k, _, _)| k.shape()[2] as usize).sum();
        let (mut keys, mut values) = (Vec::with_capacity(hkv * s * d), Vec::with_capacity(hkv * s * d));
        for g in 0..hkv {
            for (k, v, r) in &pieces {
                let (Some(k_bits), Some(v_bits)) = (bits16(k), bits16(v)) else { return Ok(None) };
                let len = k.shape()[2] as usize * d;
                let at = (r * hkv + g) * len;
                keys.extend_from_slice(&k_bits[at..at + len]);
                values.extend_from_slice(&v_bits[at..at + len]);
            }
        }
        held.push(Held::Gathered(keys, values, s));
    }
    let data: Vec<RowData> = held
        .iter()
        .map(|held| match held {
            Held::InPlace(k, v, r) => RowData {
                keys: &k.data()[r * k.row..],
                values: &v.data()[r * v.row..],
                key_heads: k.head,
                value_heads: v.head,
                s: k.array.shape()[2] as usize,
            },
            Held::Gathered(keys, values, s) => RowData { keys, values, key_heads: *s * d, value_heads: *s * d, s: *s },
        })
        .collect();
    let masks: Vec<&Mask> = rows.iter().map(|r| &r.mask).collect();
    half_attention_core(q, &data, hkv, scale, Masks::PerRow(&masks)).map(Some)
}

/// `softmax(x / temperature)` over each row of `width` float32 values, in place, bit for bit
/// MLX's divide and precise softmax on float32: a drafter's distribution to draw from. MLX's
/// ops compute each exponential twice, one element at a time: a row of 8,192 values took them
/// 100 µs (evaluated and read, best of 2,000) and takes this 10.5 µs.
pub fn tempered_softmax_rows(values: &mut [f32], width: usize, temperature: f32) {
    for v in values.iter_mut() {
        *v /= temperature;
    }
    for row in values.chunks_mut(width.max(1)) {
        softmax_row(Dtype::Float32, row);
    }
}

/// MLX's CPU softmax (precise) of one row of `dtype` values, in place: as MLX 0.32's x86
/// build runs it: the maximum, exp(x − max) by MLX's own polynomial, the float32 sum of those in
/// order, its reciprocal, then each exponential times the reciprocal, rounded once to `dtype`.
/// Bit for bit MLX's op (tested), without its round trip.
fn softmax_row(dtype: Dtype, row: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
        // SAFETY: the CPU has AVX2 and FMA (checked above).
        return unsafe { softmax_row_avx2(dtype, row) };
    }
    softmax_row_body(dtype, row)
}

/// [`softmax_row`] with the maximum and the exponentials eight at a time: each lane's maximum
/// is kept as the scalar loop keeps it (a value replaces it only if greater), and each lane's
/// exponential is the scalar one bit for bit ([`mlx_exp8`]); the sum stays in order.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn softmax_row_avx2(dtype: Dtype, row: &mut [f32]) {
    use std::arch::x86_64::*;
    let mut lanes = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut chunks = row.chunks_exact(8);
    for chunk in &mut chunks {
        lanes = _mm256_max_ps(_mm256_loadu_ps(chunk.as_ptr()), lanes);
    }
    let mut maxima = [0f32; 8];
    _mm256_storeu_ps(maxima.as_mut_ptr(), lanes);
    let greater = |m: f32, &x: &f32| if x > m { x } else { m };
    let maximum = chunks.remainder().iter().fold(maxima.iter().fold(f32::NEG_INFINITY, greater), greater);
    let shift = _mm256_set1_ps(maximum);
    let mut chunks = row.chunks_exact_mut(8);
    for chunk in &mut chunks {
        let e = mlx_exp8(_mm256_sub_ps(_mm256_loadu_ps(chunk.as_ptr()), shift));
        _mm256_storeu_ps(chunk.as_mut_ptr(), e);
    }
    for x in chunks.into_remainder() {
        *x = mlx_exp(*x - maximum);
    }
    let sum = row.iter().fold(0f32, |sum, &e| sum + e);
    scaled_to(dtype, row, 1.0 / sum);
}

#[inline(always)]
fn softmax_row_body(dtype: Dtype, row: &mut [f32]) {
    let maximum = row.iter().fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    // MLX computes each exponential twice; they are equal, so once is enough here.
    let mut sum = 0f32;
    for x in row.iter_mut() {
        *x = mlx_exp(*x - maximum);
        sum += *x;
    }
    scaled_to(dtype, row, 1.0 / sum);
}

/// Each exponential times the normalizer, rounded to `dtype`.
#[inline(always)]
fn scaled_to(dtype: Dtype, row: &mut [f32], normalizer: f32) {
    super::kernels::with_round!(dtype, |r| {
        for x in row.iter_mut() {
            *x = r.round(*x * normalizer);
        }
    });
}

/// The first largest value's index in each row of `x` [.., V], as MLX's argmax over the last
/// axis gives it. Read on the host when MLX runs on the CPU, where its arrays live in host
/// memory: the op, its conversion and their round trip to MLX's stream thread cost several
/// times the scan over a small vocabulary. MLX's op elsewhere.
pub fn argmax_rows(x: &Array) -> Result<Vec<u32>, Exception> {
    if super::wide::on_cpu() {
        let width = x.shape().last().map_or(1, |&v| v.max(1) as usize);
        let x = row_major(x)?;
        if let Some(bits) = super::kernels::bits16(&x) {
            let best: Option<Vec<u32>> = bits.chunks(width).map(|row| first_max_half(row, x.dtype())).collect();
            if let Some(best) = best {
                return Ok(best);
            }
        }
        return super::kernels::with_floats(&x, |all| all.chunks(width).map(first_max).collect());
    }
    let best = mlx_rs::ops::indexing::argmax_axis(x, -1, None)?.as_dtype(Dtype::Uint32)?;
    Ok(best.as_slice::<u32>().to_vec())
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

/// MLX's CPU exp (`simd::exp` in mlx/backend/cpu/simd/math.h): 2^(x·log₂e) as a power of two
/// times a degree-6 polynomial of the fractional part, with fused multiply-adds.
#[inline(always)]
pub fn mlx_exp(x0: f32) -> f32 {
    if x0.is_nan() {
        return x0;
    }
    if x0 > 88.0 {
        return f32::INFINITY;
    }
    if x0 < -88.0 {
        return 0.0;
    }
    let x = x0 * LOG2_E;
    let whole = (x + 0.5).floor();
    let fraction = x - whole;
    let mut p = EXP_POLYNOMIAL[0];
    for c in &EXP_POLYNOMIAL[1..] {
        p = p.mul_add(fraction, *c);
    }
    f32::from_bits(((whole as i32 + 127) << 23) as u32) * p
}

#[allow(clippy::approx_constant, reason = "MLX's literal, which its results follow")]
pub(crate) const LOG2_E: f32 = 1.442695;
/// 2^f for f in [-½, ½], highest power first.
#[allow(clippy::excessive_precision, reason = "MLX's coefficients as MLX writes them")]
pub(crate) const EXP_POLYNOMIAL: [f32; 7] = [
    1.535336188319500e-4,
    1.339887440266574e-3,
    9.618437357674640e-3,
    5.550332471162809e-2,
    2.402264791363012e-1,
    6.931472028550421e-1,
    1.0,
];

/// [`mlx_exp`] of eight values at once, each lane bit for bit the scalar result (tested).
///
/// # Safety
/// The CPU must have AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub unsafe fn mlx_exp8(x0: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let x = _mm256_mul_ps(x0, _mm256_set1_ps(LOG2_E));
    let whole = _mm256_floor_ps(_mm256_add_ps(x, _mm256_set1_ps(0.5)));
    let fraction = _mm256_sub_ps(x, whole);
    let mut p = _mm256_set1_ps(EXP_POLYNOMIAL[0]);
    for c in &EXP_POLYNOMIAL[1..] {
        p = _mm256_fmadd_ps(p, fraction, _mm256_set1_ps(*c));
    }
    // Lanes out of range are replaced below, whatever their integer conversion gave.
    let exponent = _mm256_slli_epi32::<23>(_mm256_add_epi32(_mm256_cvttps_epi32(whole), _mm256_set1_epi32(127)));
    let e = _mm256_mul_ps(_mm256_castsi256_ps(exponent), p);
    let e = _mm256_blendv_ps(e, _mm256_setzero_ps(), _mm256_cmp_ps::<_CMP_LT_OQ>(x0, _mm256_set1_ps(-88.0)));
    let e = _mm256_blendv_ps(e, _mm256_set1_ps(f32::INFINITY), _mm256_cmp_ps::<_CMP_GT_OQ>(x0, _mm256_set1_ps(88.0)));
    _mm256_blendv_ps(e, x0, _mm256_cmp_ps::<_CMP_UNORD_Q>(x0, x0))
}

/// One row's keys and values, [Hkv, s, D] as half-precision bit patterns.
struct RowData<'a> {
    /// From the row's first key; head g's s keys start `key_heads · g` values in.
    keys: &'a [u16],
    values: &'a [u16],
    key_heads: usize,
    value_heads: usize,
    s: usize,
}

/// Which keys a row's queries read, worked out on the host: every key, the last L of S keys
/// causally, or a boolean mask broadcast to [B, Hq, L, S] read off its data.
enum Visible {
    All,
    Causal,
    Bool { data: Vec<bool>, shape: [usize; 4] },
}

impl Visible {
    /// `None` for an additive mask, which stays with MLX's ops.
    fn of(mask: &Mask) -> Result<Option<Visible>, Exception> {
        Ok(Some(match mask {
            Mask::All => Visible::All,
            Mask::Causal => Visible::Causal,
            Mask::Array(m) if m.dtype() == Dtype::Bool && m.ndim() <= 4 => {
                let m = row_major(m)?;
                let mut shape = [1usize; 4];
                for (to, &d) in shape.iter_mut().rev().zip(m.shape().iter().rev()) {
                    *to = d as usize;
                }
                Visible::Bool { data: m.as_slice::<bool>().to_vec(), shape }
            }
            Mask::Array(_) => return Ok(None),
        }))
    }

    /// Which of `s` keys query `i` of head `h` in batch entry `b` reads (`l` queries): worked
    /// out once per query, so that the scores are then masked in one pass that vectorizes.
    fn keys(&self, [b, h, i]: [usize; 3], l: usize, s: usize) -> Keys<'_> {
        match self {
            Visible::All => Keys::First(s),
            Visible::Causal => Keys::First((s.saturating_sub(l) + i + 1).min(s)),
            Visible::Bool { data, shape } => {
                let at = |c: usize, d: usize| if d == 1 { 0 } else { c };
                let query = ((at(b, shape[0]) * shape[1] + at(h, shape[1])) * shape[2] + at(i, shape[2])) * shape[3];
                match shape[3] {
                    1 => Keys::First(if data[query] { s } else { 0 }),
                    _ => Keys::Marked(&data[query..query + s]),
                }
            }
        }
    }
}

/// The keys one query reads: the first n, or those marked true.
enum Keys<'a> {
    First(usize),
    Marked(&'a [bool]),
}

/// One mask for every row (rows of equal length), or one per row.
enum Masks<'a> {
    Shared(&'a Mask),
    PerRow(&'a [&'a Mask]),
}

/// The steps of [`half_attention`] for queries q [B, Hq, L, D] over each row's keys and values.
/// q is scaled here as MLX's multiply does it (both in the dtype, the product rounded to it).
/// The softmax is MLX's, computed on the host ([`softmax_row`]) for every mask but an additive
/// one.
fn half_attention_core(q: &Array, rows: &[RowData], hkv: usize, scale: f32, masks: Masks) -> Result<Array, Exception> {
    let dtype = q.dtype();
    let (hq, l, d) = (q.shape()[1] as usize, q.shape()[2] as usize, q.shape()[3] as usize);
    // Per row: which keys its queries read, and which batch entry of its mask it is.
    let (shared, per_row) = match masks {
        Masks::Shared(mask) => (Visible::of(mask)?, None),
        Masks::PerRow(masks) => (None, masks.iter().map(|m| Visible::of(m)).collect::<Result<Option<Vec<_>>, _>>()?),
    };
    let visibility: Option<Vec<(&Visible, usize)>> = match (&shared, &per_row) {
        (Some(v), _) => Some((0..rows.len()).map(|r| (v, r)).collect()),
        (_, Some(per_row)) => Some(per_row.iter().map(|v| (v, 0)).collect()),
        _ => None,
    };
    let mut out = vec![0f32; rows.len() * hq * l * d];
    with_floats(&row_major(q)?, |qs| -> Result<(), Exception> {
        let queries = Queries { qs, rows, hkv, block: hq / hkv * l, l, d, dtype, scale: round_to(dtype, scale) };
        match &visibility {
            Some(visibility) => queries.attend_split(visibility, &mut out),
            None => queries.attend_additive(masks, &mut out)?,
        }
        Ok(())
    })??;
    Ok(rounded(&out, &[rows.len() as i32, hq as i32, l as i32, d as i32], dtype))
}

/// Work (queries × keys × head dimension) from which attention's queries are split in two, the
/// second half on the products' helper thread. Each query is computed alike on either thread,
/// so the split changes no result. Medians of 2,000 calls, 4 bfloat16 query heads over one KV
/// head of dimension 64 (the demo target's sliding layers): one query over 32 keys (2¹³) took
/// 4.7–5.0 µs whole and 3.7–5.0 µs split, over 64 keys 7.1–7.9 and 5.2–6.4 µs, over 128 keys
/// 11.6–11.8 and 8.0–8.8 µs, and five queries over 128 keys (a verify window) 46.5–48.4 and
/// 28.2–29.3 µs.
const ATTENTION_SPLIT_WORK: usize = 1 << 14;

/// The queries of one attention call, flattened as (row, KV head, query of the heads sharing
/// that KV head): q's own row-major order, and the order of the output's rows. Query f of a
/// row reads the keys of that row and KV head.
struct Queries<'a> {
    /// q [B, Hq, L, D] as floats.
    qs: &'a [f32],
    rows: &'a [RowData<'a>],
    hkv: usize,
    /// Queries per (row, KV head): the heads sharing a KV head times L.
    block: usize,
    l: usize,
    d: usize,
    dtype: Dtype,
    /// Rounded to the dtype, as MLX's multiply takes it.
    scale: f32,
}

/// A run of queries `from..to` of one (row, KV head) block.
struct Segment {
    from: usize,
    to: usize,
    row: usize,
    head: usize,
}

impl Queries<'_> {
    fn len(&self) -> usize {
        self.rows.len() * self.hkv * self.block
    }

    /// `range` cut where it crosses from one (row, KV head) block to the next.
    fn segments(&self, range: std::ops::Range<usize>) -> impl Iterator<Item = Segment> + '_ {
        let block = self.block;
        let mut from = range.start;
        std::iter::from_fn(move || {
            (from < range.end).then(|| {
                let to = ((from / block + 1) * block).min(range.end);
                let segment = Segment { from, to, row: from / block / self.hkv, head: from / block % self.hkv };
                from = to;
                segment
            })
        })
    }

    /// Scores of a segment's queries [to − from, s]: q scaled as MLX's multiply does it (both
    /// in the dtype, the product rounded to it), times the row's keys of its KV head.
    fn scores(&self, segment: &Segment, scores: &mut Vec<f32>) {
        use super::kernels::dot::{self, Weight};
        let (row, d, dtype) = (&self.rows[segment.row], self.d, self.dtype);
        let n = segment.to - segment.from;
        let mut x = vec![0f32; n * d];
        with_round!(dtype, |r| {
            for (x, &v) in x.iter_mut().zip(&self.qs[segment.from * d..segment.to * d]) {
                *x = r.round(v * self.scale);
            }
        });
        let at = scores.len();
        scores.resize(at + n * row.s, 0.0);
        let bits = &row.keys[segment.head * row.key_heads..][..row.s * d];
        let keys = if dtype == Dtype::Bfloat16 { Weight::Bf16(bits) } else { Weight::F16(bits) };
        dot::product(&x, dtype, n, d, keys, 0..row.s, row.s, &mut scores[at..]);
    }

    /// A segment's output rows: its probabilities [to − from, s] times the row's values.
    fn weighted_sums(&self, segment: &Segment, ps: &[f32], out: &mut [f32]) {
        let (row, d) = (&self.rows[segment.row], self.d);
        let values = &row.values[segment.head * row.value_heads..][..row.s * d];
        super::kernels::weighted_sum::weighted_sum(ps, segment.to - segment.from, row.s, values, self.dtype, d, out);
    }

    /// Queries `range` whose masks the host reads, their output rows into `out`: scores, masked
    /// as MLX masks (the dtype's lowest value), MLX's softmax, then the values.
    fn attend(&self, range: std::ops::Range<usize>, visibility: &[(&Visible, usize)], out: &mut [f32]) {
        let lowest = f32::from_bits(if self.dtype == Dtype::Bfloat16 { 0xFF7F_0000 } else { 0xC77F_E000 });
        let mut ps = Vec::new();
        for segment in self.segments(range.clone()) {
            let s = self.rows[segment.row].s;
            let (visible, b) = visibility[segment.row];
            ps.clear();
            self.scores(&segment, &mut ps);
            for (f, scores) in (segment.from..segment.to).zip(ps.chunks_exact_mut(s.max(1))) {
                // The query's place in its row: head h, position i.
                let within = f - segment.row * self.hkv * self.block;
                let (h, i) = (within / self.l, within % self.l);
                with_round!(self.dtype, |r| match visible.keys([b, h, i], self.l, s) {
                    Keys::First(n) => {
                        scores[..n].iter_mut().for_each(|v| *v = r.round(*v));
                        scores[n..].fill(lowest);
                    }
                    Keys::Marked(marks) => {
                        for (v, &seen) in scores.iter_mut().zip(marks) {
                            *v = if seen { r.round(*v) } else { lowest };
                        }
                    }
                });
                softmax_row(self.dtype, scores);
            }
            let d = self.d;
            let out = &mut out[(segment.from - range.start) * d..(segment.to - range.start) * d];
            self.weighted_sums(&segment, &ps, out);
        }
    }

    /// [`Self::attend`] over every query, in two halves of about equal work, the second on the
    /// products' helper thread, when there is enough work to pay for the handover.
    fn attend_split(&self, visibility: &[(&Visible, usize)], out: &mut [f32]) {
        let work = |f: usize| self.rows[f / self.block / self.hkv].s;
        let total: usize = (0..self.len()).map(work).sum();
        if total * self.d < ATTENTION_SPLIT_WORK || self.len() < 2 {
            return self.attend(0..self.len(), visibility, out);
        }
        let mut half = 0;
        let mut done = 0;
        while half < self.len() - 1 && 2 * done < total {
            done += work(half);
            half += 1;
        }
        let (first, second) = out.split_at_mut(half * self.d);
        super::helper::join(
            || self.attend(0..half, visibility, first),
            || self.attend(half..self.len(), visibility, second),
        );
    }

    /// Every query under additive masks: the host's scores, MLX's masking and softmax (one op
    /// over every row when they share a mask, else one per row, evaluated together), then the
    /// host's weighted sums.
    fn attend_additive(&self, masks: Masks, out: &mut [f32]) -> Result<(), Exception> {
        let (dtype, l) = (self.dtype, self.l as i32);
        let hq = (self.block / self.l * self.hkv) as i32;
        let mut scores = Vec::new();
        for segment in self.segments(0..self.len()) {
            self.scores(&segment, &mut scores);
        }
        let lowest = scalar(f32::from_bits(if dtype == Dtype::Bfloat16 { 0xFF7F_0000 } else { 0xC77F_E000 }), dtype)?;
        let softmax = |scores: &[f32], b: usize, s: usize, mask: &Mask| -> Result<Array, Exception> {
            let scores = rounded(scores, &[b as i32, hq, l, s as i32], dtype);
            let scores = match mask {
                Mask::All => scores,
                Mask::Causal => {
                    let offset = (s as i32 - l).max(0);
                    let rows = Array::from_iter(offset..offset + l, &[l, 1]);
                    let cols = Array::from_iter(0..s as i32, &[1, s as i32]);
                    mlx_rs::ops::select(&rows.ge(&cols)?, &scores, &lowest)?
                }
                Mask::Array(m) if m.dtype() == Dtype::Bool => mlx_rs::ops::select(m, &scores, &lowest)?,
                Mask::Array(m) => scores.add(m)?,
            };
            mlx_rs::ops::softmax_axis(&scores, -1, true)
        };
        let probs: Vec<Array> = match masks {
            Masks::Shared(mask) => vec![softmax(&scores, self.rows.len(), self.rows.first().map_or(0, |r| r.s), mask)?],
            Masks::PerRow(masks) => {
                let mut at = 0;
                let mut per_row = Vec::with_capacity(self.rows.len());
                for (row, mask) in self.rows.iter().zip(masks) {
                    let len = self.hkv * self.block * row.s;
                    per_row.push(softmax(&scores[at..at + len], 1, row.s, mask)?);
                    at += len;
                }
                per_row
            }
        };
        mlx_rs::transforms::eval(&probs)?;
        let mut ps = Vec::with_capacity(scores.len());
        for p in &probs {
            with_floats(&row_major(p)?, |p| ps.extend_from_slice(p))?;
        }
        let mut at = 0;
        for segment in self.segments(0..self.len()) {
            let n = (segment.to - segment.from) * self.rows[segment.row].s;
            self.weighted_sums(&segment, &ps[at..at + n], &mut out[segment.from * self.d..segment.to * self.d]);
            at += n;
        }
        Ok(())
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod exp_tests {
    use std::arch::x86_64::*;

    #[test]
    fn eight_exponentials_at_once_are_the_scalar_ones() {
        if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")) {
            return;
        }
        // Every 97th float32 bit pattern: NaNs, infinities, subnormals and both ends of the range.
        let values: Vec<f32> = (0..u32::MAX / 97).map(|i| f32::from_bits(i * 97)).collect();
        for chunk in values.chunks_exact(8) {
            let mut lanes = [0f32; 8];
            // SAFETY: the CPU has AVX2 and FMA (checked above).
            unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), super::mlx_exp8(_mm256_loadu_ps(chunk.as_ptr()))) };
            for (lane, &x) in lanes.iter().zip(chunk) {
                assert_eq!(lane.to_bits(), super::mlx_exp(x).to_bits(), "exp({x})");
            }
        }
    }
}

#[cfg(test)]
mod rms_norm_tests {
    use mlx_rs::random;

    use super::*;

    #[test]
    fn equals_mlxs_bit_for_bit() {
        for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
            for (seed, (rows, n)) in [(1, 256), (5, 100), (3, 2560), (2, 17), (7, 64), (19, 64)].into_iter().enumerate()
            {
                let key = |k: u64| random::key(seed as u64 * 10 + k).unwrap();
                let spread = Array::from_f32([0.05, 1.0, 40.0][seed % 3]);
                let x = random::normal::<f32>(&[rows, n], None, None, &key(1)).unwrap().multiply(&spread).unwrap();
                let x = x.as_dtype(dtype).unwrap();
                let w = random::normal::<f32>(&[n], None, None, &key(2)).unwrap().as_dtype(dtype).unwrap();
                for weight in [Some(&w), None] {
                    let ours = cpu_rms_norm(&x, weight, 1e-6).unwrap().expect("covered");
                    let mlx = mlx_rs::fast::rms_norm(&x, weight, 1e-6).unwrap();
                    assert_eq!(ours.dtype(), mlx.dtype());
                    let differing = ours.ne(&mlx).unwrap().sum(None).unwrap().item_cast::<u32>();
                    assert_eq!(differing, 0, "{dtype:?}, [{rows}, {n}], weight {}", weight.is_some());
                }
            }
        }
    }
}

#[cfg(test)]
mod elementwise_tests {
    use mlx_rs::random;

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

    /// Largest |a − b| relative to the largest |b|.
    fn relative_difference(a: &Array, b: &Array) -> f32 {
        let diff = a.subtract(b).unwrap().abs().unwrap().max(None).unwrap().item_exact::<f32>();
        diff / b.abs().unwrap().max(None).unwrap().item_exact::<f32>()
    }

    /// Float32 takes vector code for MLX's `powf` and `tanhf` (see `nn::tanh`): MLX's result
    /// within a few units in the last place.
    #[test]
    fn float32_is_mlxs_within_rounding() {
        for (seed, spread) in [0.3f32, 2.0, 9.0].into_iter().enumerate() {
            let key = |k: u64| random::key(seed as u64 * 10 + k).unwrap();
            let normal = |k| random::normal::<f32>(&[7, 300], None, None, &key(k)).unwrap();
            let gate = normal(1).multiply(Array::from_f32(spread)).unwrap();
            let up = normal(2);
            let ours = cpu_geglu(&gate, &up).unwrap().expect("covered");
            let d = relative_difference(&ours, &gelu_approx(&gate).unwrap().multiply(&up).unwrap());
            assert!(d <= 1e-6, "geglu, spread {spread}: {d}");
            let logits = gate.multiply(Array::from_f32(10.0)).unwrap();
            let c = Array::from_f32(30.0);
            let mlx = mlx_rs::ops::tanh(logits.divide(&c).unwrap()).unwrap().multiply(&c).unwrap();
            let d = relative_difference(&softcap(&logits, 30.0).unwrap(), &mlx);
            assert!(d <= 1e-6, "softcap, spread {spread}: {d}");
        }
    }

    #[test]
    fn half_precision_equals_mlxs_bit_for_bit() {
        for dtype in [Dtype::Bfloat16, Dtype::Float16] {
            for (seed, spread) in [0.3f32, 2.0, 9.0].into_iter().enumerate() {
                let key = |k: u64| random::key(seed as u64 * 10 + k).unwrap();
                let normal = |k| random::normal::<f32>(&[7, 300], None, None, &key(k)).unwrap();
                let gate = normal(1).multiply(Array::from_f32(spread)).unwrap().as_dtype(dtype).unwrap();
                let up = normal(2).as_dtype(dtype).unwrap();
                let ours = cpu_geglu(&gate, &up).unwrap().expect("covered");
                let mlx = gelu_approx(&gate).unwrap().multiply(&up).unwrap();
                assert_eq!(ours.dtype(), mlx.dtype());
                let differing = ours.ne(&mlx).unwrap().sum(None).unwrap().item_cast::<u32>();
                assert_eq!(differing, 0, "{dtype:?}, spread {spread}");
            }
        }
    }

    /// Every finite value of a half-precision `dtype`, as an array of that dtype.
    fn every_finite(dtype: Dtype) -> Array {
        let values: Vec<f32> = (0..=u16::MAX)
            .map(|b| match dtype {
                Dtype::Bfloat16 => f32::from_bits((b as u32) << 16),
                _ => half::f16::from_bits(b).to_f32(),
            })
            .filter(|v| v.is_finite())
            .collect();
        Array::from_slice(&values, &[values.len() as i32]).as_dtype(dtype).unwrap()
    }

    /// The softcap tables, checked at every finite value a logit can take.
    #[test]
    fn every_finite_half_precision_logit_softcaps_as_mlx_does() {
        for dtype in [Dtype::Bfloat16, Dtype::Float16] {
            let x = every_finite(dtype);
            for cap in [30.0f32, 15.0] {
                let ours = softcap(&x, cap).unwrap();
                let c = scalar(cap, dtype).unwrap();
                let mlx = mlx_rs::ops::tanh(x.divide(&c).unwrap()).unwrap().multiply(&c).unwrap();
                assert_eq!(ours.dtype(), dtype);
                let differing = ours.ne(&mlx).unwrap().sum(None).unwrap().item_cast::<u32>();
                assert_eq!(differing, 0, "{dtype:?}, cap {cap}");
            }
        }
    }

    /// `ours` equals `mlx` at every finite value a half-precision gate can take, times random
    /// ups (drawn with `seed`).
    fn equal_at_every_finite_gate(
        ours: impl Fn(&Array, &Array) -> Option<Array>,
        mlx: impl Fn(&Array, &Array) -> Array,
        seed: u64,
    ) {
        for gate in [every_finite(Dtype::Bfloat16), every_finite(Dtype::Float16)] {
            let n = gate.shape()[0];
            let up = random::normal::<f32>(&[n], None, None, &random::key(seed).unwrap())
                .unwrap()
                .as_dtype(gate.dtype())
                .unwrap();
            let ours = ours(&gate, &up).expect("covered");
            let differing = ours.ne(mlx(&gate, &up)).unwrap().sum(None).unwrap().item_cast::<u32>();
            assert_eq!(differing, 0, "{:?}", gate.dtype());
        }
    }

    /// The half-precision tables, checked at every finite value a gate can take.
    #[test]
    fn every_finite_half_precision_gate_equals_mlxs() {
        equal_at_every_finite_gate(
            |gate, up| cpu_geglu(gate, up).unwrap(),
            |gate, up| gelu_approx(gate).unwrap().multiply(up).unwrap(),
            5,
        );
    }

    #[test]
    fn swiglu_equals_mlxs_at_every_finite_half_precision_gate() {
        equal_at_every_finite_gate(
            |gate, up| cpu_swiglu(gate, up).unwrap(),
            |gate, up| gate.multiply(mlx_rs::ops::sigmoid(gate).unwrap()).unwrap().multiply(up).unwrap(),
            6,
        );
    }
}

#[cfg(test)]
mod half_attention_tests {
    use mlx_rs::ops::indexing::TryIndexOp;
    use mlx_rs::random;

    use super::*;

    fn normal(shape: &[i32], seed: u64, dtype: Dtype) -> Array {
        random::normal::<f32>(shape, None, None, &random::key(seed).unwrap()).unwrap().as_dtype(dtype).unwrap()
    }

    fn largest_difference(a: &Array, b: &Array) -> f32 {
        let (a, b) = (a.as_dtype(Dtype::Float32).unwrap(), b.as_dtype(Dtype::Float32).unwrap());
        a.subtract(&b).unwrap().abs().unwrap().max(None).unwrap().item_exact::<f32>()
    }

    #[test]
    fn the_host_softmax_is_mlxs_bit_for_bit() {
        for dtype in [Dtype::Bfloat16, Dtype::Float16, Dtype::Float32] {
            // The lowest value of the dtype, as the attention masks with it.
            let lowest = match dtype {
                Dtype::Bfloat16 => f32::from_bits(0xFF7F_0000),
                Dtype::Float16 => -65504.0,
                _ => f32::MIN,
            };
            for (len, seed) in [(1, 1), (7, 2), (40, 3), (129, 4), (300, 5), (2048, 6), (8192, 7)] {
                let x = normal(&[3, len], seed, Dtype::Float32).multiply(Array::from_f32(4.0)).unwrap();
                let keep = Array::from_iter((0..3 * len).map(|i| i % 7 != 3 || len == 1), &[3, len]);
                let x = mlx_rs::ops::select(&keep, &x, Array::from_f32(lowest)).unwrap().as_dtype(dtype).unwrap();
                let mlx = mlx_rs::ops::softmax_axis(&x, -1, true).unwrap().as_dtype(Dtype::Float32).unwrap();
                let mut ours = x.as_dtype(Dtype::Float32).unwrap().as_slice::<f32>().to_vec();
                for row in ours.chunks_mut(len as usize) {
                    softmax_row(dtype, row);
                }
                let differ = ours.iter().zip(mlx.as_slice::<f32>()).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
                assert_eq!(differ, 0, "{dtype:?}, length {len}: {differ} of {} differ", ours.len());
            }
        }
    }

    #[test]
    fn tempered_softmax_is_mlxs_divide_and_softmax_bit_for_bit() {
        let x = normal(&[3, 8192], 8, Dtype::Float32).multiply(Array::from_f32(5.0)).unwrap();
        let x = x.as_dtype(Dtype::Bfloat16).unwrap().as_dtype(Dtype::Float32).unwrap();
        let mlx = mlx_rs::ops::softmax_axis(x.divide(Array::from_f32(0.7)).unwrap(), -1, true).unwrap();
        let mut ours = x.as_slice::<f32>().to_vec();
        tempered_softmax_rows(&mut ours, 8192, 0.7);
        let differ = ours.iter().zip(mlx.as_slice::<f32>()).filter(|(a, b)| a.to_bits() != b.to_bits()).count();
        assert_eq!(differ, 0, "{differ} of {} differ", ours.len());
    }

    /// Keys and values given as the first slots of a larger cache (a view, read in place) give
    /// what their row-major copies give, bit for bit.
    #[test]
    fn reads_a_caches_first_slots_in_place() {
        let dtype = Dtype::Bfloat16;
        let q = normal(&[2, 4, 1, 64], 1, dtype);
        let (k, v) = (normal(&[2, 2, 48, 64], 2, dtype), normal(&[2, 2, 48, 64], 3, dtype));
        let (k, v) = (crate::nn::layout::first_slots(&k, 37).unwrap(), crate::nn::layout::first_slots(&v, 37).unwrap());
        let view = InPlace::of(&k).unwrap();
        let strides = [view.row, view.head];
        assert_eq!((view.array.shape(), strides), (&[2, 2, 37, 64][..], [2 * 48 * 64, 48 * 64]), "not read in place");
        let in_place = attention(&q, &k, &v, 0.125, &Mask::All).unwrap();
        let copied = attention(&q, &row_major(&k).unwrap(), &row_major(&v).unwrap(), 0.125, &Mask::All).unwrap();
        assert_eq!(largest_difference(&in_place, &copied), 0.0);
        let reference = mlx_rs::fast::scaled_dot_product_attention(&q, &k, &v, 0.125, None, None).unwrap();
        assert!(largest_difference(&in_place, &reference) < 0.05);
    }

    #[test]
    fn attends_over_a_storages_first_slots_as_over_their_copy() {
        for dtype in [Dtype::Bfloat16, Dtype::Float32] {
            let q = normal(&[2, 4, 3, 64], 1, dtype);
            let (k, v) = (normal(&[2, 2, 48, 64], 2, dtype), normal(&[2, 2, 48, 64], 3, dtype));
            let copy = |a: &Array| row_major(&a.try_index((.., .., ..37)).unwrap()).unwrap();
            for mask in [Mask::All, Mask::Causal] {
                let over_slots = attention_over_slots(&q, &k, &v, 37, 0.125, &mask).unwrap();
                let over_copy = attention(&q, &copy(&k), &copy(&v), 0.125, &mask).unwrap();
                assert_eq!(over_slots.shape(), &[2, 4, 3, 64]);
                assert_eq!(largest_difference(&over_slots, &over_copy), 0.0, "{dtype:?}");
            }
        }
    }

    #[test]
    fn equals_mlxs_attention_within_a_rounding_step_and_ignores_how_many_queries_share_it() {
        for dtype in [Dtype::Bfloat16, Dtype::Float16] {
            let (q, k, v) = (
                normal(&[1, 4, 6, 32], 1, dtype),
                normal(&[1, 2, 40, 32], 2, dtype),
                normal(&[1, 2, 40, 32], 3, dtype),
            );
            let visible = Array::from_iter((0..6 * 40).map(|i| (i * 7) % 5 != 0), &[1, 1, 6, 40]);
            for (name, mask) in [("all", Mask::All), ("causal", Mask::Causal), ("array", Mask::Array(visible))] {
                let ours = attention(&q, &k, &v, 0.17, &mask).unwrap();
                let sdpa_mask = match &mask {
                    Mask::All => None,
                    Mask::Causal => Some(ScaledDotProductAttentionMask::Causal),
                    Mask::Array(m) => Some(ScaledDotProductAttentionMask::Array(m)),
                };
                let mlx = mlx_rs::fast::scaled_dot_product_attention(&q, &k, &v, 0.17, sdpa_mask, None).unwrap();
                // Outputs are near 1 in size: a rounding step is 2⁻⁸ (bfloat16) or 2⁻¹¹.
                assert!(largest_difference(&ours, &mlx) <= 2f32.powi(-7), "{dtype:?} {name}");
            }
            // The last query alone (a decode step) gives what it gives among six (a window).
            let window = attention(&q, &k, &v, 0.17, &Mask::Causal).unwrap();
            let last = q.try_index((.., .., 5..6)).unwrap();
            let alone = attention(&last, &k, &v, 0.17, &Mask::Causal).unwrap();
            assert_eq!(largest_difference(&alone, &window.try_index((.., .., 5..6)).unwrap()), 0.0, "{dtype:?}");
        }
    }

    /// Each query of a verify window gives what it gives alone over the keys it sees, whether
    /// either call splits its queries between two threads or not.
    #[test]
    fn a_windows_queries_equal_each_query_alone_across_the_threads_split() {
        let dtype = Dtype::Bfloat16;
        for (s, d) in [(20, 64), (300, 64), (300, 128)] {
            let q = normal(&[1, 8, 5, d], 7, dtype);
            let (k, v) = (normal(&[1, 2, s, d], 8, dtype), normal(&[1, 2, s, d], 9, dtype));
            let window = attention(&q, &k, &v, 0.125, &Mask::Causal).unwrap();
            for i in 0..5 {
                let seen = s - 4 + i;
                let keys = |a: &Array| a.try_index((.., .., ..seen)).unwrap();
                let query = q.try_index((.., .., i..i + 1)).unwrap();
                let alone = attention(&query, &keys(&k), &keys(&v), 0.125, &Mask::All).unwrap();
                let row = window.try_index((.., .., i..i + 1)).unwrap();
                assert_eq!(largest_difference(&alone, &row), 0.0, "{s} keys of {d}, query {i}");
            }
        }
    }

    /// Rows of different key counts in one call, each key set in two pieces, give what each row
    /// gives alone over its keys in one piece.
    #[test]
    fn rows_of_different_lengths_equal_each_row_alone_bit_for_bit() {
        for dtype in [Dtype::Bfloat16, Dtype::Float16, Dtype::Float32] {
            let q = normal(&[3, 4, 5, 32], 4, dtype);
            let (block_k, block_v) = (normal(&[3, 2, 5, 32], 5, dtype), normal(&[3, 2, 5, 32], 6, dtype));
            let contexts: Vec<(Array, Array)> = [7, 19, 12]
                .iter()
                .enumerate()
                .map(|(r, &n)| {
                    (normal(&[1, 2, n, 32], 10 + r as u64, dtype), normal(&[1, 2, n, 32], 20 + r as u64, dtype))
                })
                .collect();
            let mask = |r: usize, n: i32| match r {
                0 => Mask::All,
                1 => Mask::Causal,
                _ => Mask::Array(Array::from_iter((0..5 * (n + 5)).map(|i| (i * 7) % 5 != 0), &[1, 1, 5, n + 5])),
            };
            let rows: Vec<RowKeys> = contexts
                .iter()
                .enumerate()
                .map(|(r, (k, v))| RowKeys {
                    pieces: vec![
                        KeyPiece { keys: k, values: v, row: 0 },
                        KeyPiece { keys: &block_k, values: &block_v, row: r },
                    ],
                    mask: mask(r, k.shape()[2]),
                })
                .collect();
            let together = attention_rows(&q, &rows, 0.17).unwrap();
            for (r, (k, v)) in contexts.iter().enumerate() {
                let take = |a: &Array| a.try_index(r as i32..r as i32 + 1).unwrap();
                let keys = mlx_rs::ops::concatenate(&[k, &take(&block_k)], 2).unwrap();
                let values = mlx_rs::ops::concatenate(&[v, &take(&block_v)], 2).unwrap();
                let alone = attention(&take(&q), &keys, &values, 0.17, &mask(r, k.shape()[2])).unwrap();
                assert_eq!(largest_difference(&take(&together), &alone), 0.0, "{dtype:?}, row {r}");
            }
        }
    }
}

//! The activations of the models' MLPs and the logits' softcap over host arrays: GeGLU and
//! SwiGLU in one pass, half-precision values through tables of MLX's own results.

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::arrays::{avx2_where_available, bf16_bits, bits16, from_bits16, round_to, rounded, row_major, with_floats};
use crate::{helper, tanh};

/// GeGLU, `gelu_approx(gate) ⊙ up`, where the CPU route covers it; `None` for MLX's ops.
pub fn geglu(gate: &Array, up: &Array) -> Result<Option<Array>, Exception> {
    if !crate::route::on_cpu() {
        return Ok(None);
    }
    cpu_geglu(gate, up)
}

/// SwiGLU, `silu(gate) ⊙ up`, where the CPU route covers it; `None` for MLX's ops.
pub fn swiglu(gate: &Array, up: &Array) -> Result<Option<Array>, Exception> {
    if !crate::route::on_cpu() {
        return Ok(None);
    }
    cpu_swiglu(gate, up)
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
    let (gate, up) = (row_major(gate)?, row_major(up)?);
    let (Some(gates), Some(ups)) = (bits16(&gate), bits16(&up)) else {
        return Err(Exception::custom("half-precision gate and up"));
    };
    let mut y = vec![0u16; gates.len()];
    let bf16 = gate.dtype() == Dtype::Bfloat16;
    // Element by element: each half of a prefill's on its own thread.
    helper::rows_in_halves(&mut y, 1, |from, y| {
        let (gates, ups) = (&gates[from..from + y.len()], &ups[from..from + y.len()]);
        if bf16 {
            return times_looked_up_bf16(table, gates, ups, y);
        }
        for ((y, &g), &u) in y.iter_mut().zip(gates).zip(ups) {
            *y = half::f16::from_f32(table[g as usize] * half::f16::from_bits(u).to_f32()).to_bits();
        }
    });
    Ok(from_bits16(&y, gate.shape(), gate.dtype()))
}

avx2_where_available! {
    /// [`times_looked_up`] for bfloat16.
    fn times_looked_up_bf16(table: &[f32], gates: &[u16], ups: &[u16], y: &mut [u16]) {
        let table: &[f32; 1 << 16] = table.try_into().expect("a table of every 16-bit pattern");
        for ((y, &g), &u) in y.iter_mut().zip(gates).zip(ups) {
            *y = bf16_bits(table[g as usize] * f32::from_bits((u as u32) << 16));
        }
    }
}

/// [`geglu`]'s nine MLX ops in one pass, each step rounded to the dtype as MLX rounds it, with
/// the C library's `powf` and `tanhf` that MLX's CPU ops call: MLX's result bit for bit
/// (tested), without nine dispatches of microseconds each. `None` for what it does not cover.
fn cpu_geglu(gate: &Array, up: &Array) -> Result<Option<Array>, Exception> {
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
    // Float32: MLX's steps in vector code (`x · x · x` for its `powf`, and `tanh`), within
    // a few units in the last place of MLX's result.
    let (gate, up) = (row_major(gate)?, row_major(up)?);
    let y = with_floats(&gate, |gates| {
        with_floats(&up, |ups| {
            let mut y = vec![0f32; gates.len()];
            helper::rows_in_halves(&mut y, 1, |from, y| {
                let (gates, ups) = (&gates[from..from + y.len()], &ups[from..from + y.len()]);
                tanh::zip_into(gates, ups, y, |g, u| gelu_float32(g) * u)
            });
            rounded(&y, gate.shape(), dtype)
        })
    })??;
    Ok(Some(y))
}

/// gelu_tanh(x) in float32, by MLX's steps.
#[inline(always)]
fn gelu_float32(x: f32) -> f32 {
    const C: f32 = 0.044715;
    let k = (2.0 / std::f32::consts::PI).sqrt();
    let inner = (x + x * x * x * C) * k;
    x * 0.5 * (tanh::tanh(inner) + 1.0)
}

/// gelu_tanh(x) as MLX's ops compute it in `dtype`, every step rounded.
fn gelu(dtype: Dtype, x: f32) -> f32 {
    let round = |v| round_to(dtype, v);
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
        with_floats(&op(&every)?, <[f32]>::to_vec)
    })
}

/// gelu's table: a lookup instead of a `powf` and a `tanhf` per element, which would otherwise
/// take a sizable share of a batched verify round.
fn half_gelu_table(dtype: Dtype) -> Option<&'static [f32]> {
    half_table(dtype, "gelu", 0.0, |x| gelu(dtype, x))
}

/// `tanh(x / cap) · cap` where the CPU route covers it (half precision by a table of MLX's
/// steps, float32 by MLX's steps in vector code); `None` for MLX's ops.
pub fn softcap(x: &Array, cap: f32) -> Result<Option<Array>, Exception> {
    if !crate::route::on_cpu() {
        return Ok(None);
    }
    cpu_softcap(x, cap)
}

fn cpu_softcap(x: &Array, cap: f32) -> Result<Option<Array>, Exception> {
    if let Some(table) = half_softcap_table(x.dtype(), cap) {
        // Bit pattern to bit pattern: the table's values are the dtype's own.
        let x = row_major(x)?;
        let bits = bits16(&x).ok_or_else(|| Exception::custom("half-precision logits"))?;
        let capped: Vec<u16> = match x.dtype() {
            Dtype::Bfloat16 => bits.iter().map(|&b| (table[b as usize].to_bits() >> 16) as u16).collect(),
            _ => bits.iter().map(|&b| half::f16::from_f32(table[b as usize]).to_bits()).collect(),
        };
        return Ok(Some(from_bits16(&capped, x.shape(), x.dtype())));
    }
    if x.dtype() == Dtype::Float32 {
        // MLX's three steps, its `tanhf` replaced by vector code (see `tanh`).
        let x = row_major(x)?;
        let y = tanh::map(x.as_slice::<f32>(), |v| tanh::tanh(v / cap) * cap);
        return Ok(Some(Array::from_slice(&y, x.shape())));
    }
    Ok(None)
}

/// The softcap's table, by MLX's three steps (divide, the C library's `tanhf`, multiply), each
/// rounded to the dtype: a lookup per logit instead of three MLX ops over the vocabulary.
fn half_softcap_table(dtype: Dtype, cap: f32) -> Option<&'static [f32]> {
    let round = |v| round_to(dtype, v);
    let c = round(cap);
    half_table(dtype, "softcap", cap, |x| round(round(round(x / c).tanh()) * c))
}

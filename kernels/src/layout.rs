//! Reshapes, head transposes, sums and KV-cache slot moves of small arrays, done on the host on
//! the CPU device.
//!
//! Between the host's own kernels (products, norms, rope, attention), each MLX op that
//! reshapes, transposes or adds costs a round trip to MLX's stream thread when the next kernel
//! evaluates its input, many times what copying a decode step's few kilobytes costs. A layer
//! meets about ten of them. Each function here gives what the MLX op gives, bit for bit (a sum
//! or product of the widened values rounded once to the dtype, as MLX's binary ops round), and
//! leaves larger arrays, other dtypes and other devices to MLX.

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::arrays::{bf16_elementwise, bits16, from_bits16, rounded, row_major, with_floats, Bf16Op};

/// Elements up to which copying on the host costs less than an MLX op's round trip.
const HOST_ELEMENTS: usize = 1 << 18;

fn on_host(x: &Array) -> bool {
    x.size() <= HOST_ELEMENTS
        && matches!(x.dtype(), Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        && crate::route::on_cpu()
}

/// Calls `f` with x's row-major data as its element type, for the dtypes [`on_host`] takes.
macro_rules! with_elements {
    ($x:expr, |$data:ident| $body:expr) => {
        match $x.dtype() {
            Dtype::Float32 => {
                let $data = $x.as_slice::<f32>();
                $body
            }
            Dtype::Bfloat16 => {
                let $data = $x.as_slice::<half::bf16>();
                $body
            }
            _ => {
                let $data = $x.as_slice::<half::f16>();
                $body
            }
        }
    };
}

/// `x.reshape(shape)`.
pub fn reshape(x: &Array, shape: &[i32]) -> Result<Array, Exception> {
    if !on_host(x) {
        return x.reshape(shape);
    }
    let x = row_major(x)?;
    Ok(with_elements!(x, |data| Array::from_slice(data, shape)))
}

/// Axes 1 and 2 of x [B, A, C, D] swapped, [B, C, A, D]: queries, keys and values from
/// [B, L, H, D] to [B, H, L, D] and back (row-major when done here).
pub fn swap_axes_1_2(x: &Array) -> Result<Array, Exception> {
    if !on_host(x) || x.ndim() != 4 {
        return x.transpose_axes(&[0, 2, 1, 3]);
    }
    let x = row_major(x)?;
    let s = x.shape().to_vec();
    Ok(with_elements!(x, |data| Array::from_slice(&swapped(data, &s), &[s[0], s[2], s[1], s[3]])))
}

fn swapped<T: Copy>(data: &[T], s: &[i32]) -> Vec<T> {
    let [b, a, c, d] = [s[0], s[1], s[2], s[3]].map(|v| v as usize);
    let mut out = Vec::with_capacity(data.len());
    for bi in 0..b {
        for ci in 0..c {
            for ai in 0..a {
                let from = ((bi * a + ai) * c + ci) * d;
                out.extend_from_slice(&data[from..from + d]);
            }
        }
    }
    out
}

/// Index `i` of axis 2 of x [B, L, N, W], as [B, L, W].
pub fn index_axis_2(x: &Array, i: usize) -> Result<Array, Exception> {
    if !on_host(x) || x.ndim() != 4 {
        return x.take_axis(Array::from_int(i as i32), 2);
    }
    let x = row_major(x)?;
    let s = x.shape().to_vec();
    let (n, w) = (s[2] as usize, s[3] as usize);
    let shape = [s[0], s[1], s[3]];
    Ok(with_elements!(x, |data| {
        let picked: Vec<_> = data.chunks(n * w).flat_map(|group| &group[i * w..(i + 1) * w]).copied().collect();
        Array::from_slice(&picked, &shape)
    }))
}

/// Rows `range` of the first axis of x [N, …], as [range.len(), …].
pub fn rows(x: &Array, range: std::ops::Range<usize>) -> Result<Array, Exception> {
    let mut shape = x.shape().to_vec();
    if !on_host(x) || shape.is_empty() {
        let index = Array::from_iter(range.start as i32..range.end as i32, &[range.len() as i32]);
        return x.take_axis(index, 0);
    }
    let x = row_major(x)?;
    let per_row = x.size() / shape[0].max(1) as usize;
    shape[0] = range.len() as i32;
    Ok(with_elements!(x, |data| Array::from_slice(&data[range.start * per_row..range.end * per_row], &shape)))
}

/// Arrays of one dtype and of equal shapes but for `axis`, end to end along it: rows of a
/// batch, a drafter's [embedding; hidden] input, its context's keys grown by a block's.
pub fn concat(parts: &[&Array], axis: usize) -> Result<Array, Exception> {
    let Some(first) = parts.first() else { return mlx_rs::ops::concatenate(parts, axis as i32) };
    let n = first.ndim();
    let fits = |p: &&Array| {
        p.dtype() == first.dtype() && p.ndim() == n && (0..n).all(|a| a == axis || p.shape()[a] == first.shape()[a])
    };
    if axis >= n || !parts.iter().all(|p| on_host(p) && fits(p)) {
        return mlx_rs::ops::concatenate(parts, axis as i32);
    }
    let parts = parts.iter().map(|p| row_major(p)).collect::<Result<Vec<_>, _>>()?;
    let outer: usize = first.shape()[..axis].iter().map(|&d| d as usize).product();
    let inner: usize = first.shape()[axis + 1..].iter().map(|&d| d as usize).product();
    // Per part, the elements one index of the axes before `axis` holds.
    let runs: Vec<usize> = parts.iter().map(|p| p.shape()[axis] as usize * inner).collect();
    let mut shape = first.shape().to_vec();
    shape[axis] = parts.iter().map(|p| p.shape()[axis]).sum();
    let head = &parts[0];
    Ok(with_elements!(head, |elements| {
        // Typed after the first part's elements.
        let mut data = elements[..0].to_vec();
        data.reserve(outer * runs.iter().sum::<usize>());
        for o in 0..outer {
            for (p, &run) in parts.iter().zip(&runs) {
                data.extend_from_slice(&p.as_slice()[o * run..(o + 1) * run]);
            }
        }
        Array::from_slice(&data, &shape)
    }))
}

/// x's elements at `ranges`, one range per axis (MLX's slice with unit strides): the rows,
/// positions or slots a drafter keeps.
pub fn slice(x: &Array, ranges: &[std::ops::Range<usize>]) -> Result<Array, Exception> {
    let shape = x.shape().to_vec();
    let fits =
        ranges.len() == shape.len() && ranges.iter().zip(&shape).all(|(r, &d)| r.start <= r.end && r.end <= d as usize);
    if !fits {
        return Err(Exception::custom(format!("slice {ranges:?} of an array of shape {shape:?}")));
    }
    if !on_host(x) || shape.is_empty() {
        let mut y = x.clone();
        for (axis, r) in ranges.iter().enumerate() {
            if r.len() != shape[axis] as usize {
                let index = Array::from_iter(r.start as i32..r.end as i32, &[r.len() as i32]);
                y = y.take_axis(index, axis as i32)?;
            }
        }
        return Ok(y);
    }
    let x = row_major(x)?;
    let out: Vec<i32> = ranges.iter().map(|r| r.len() as i32).collect();
    Ok(with_elements!(x, |data| Array::from_slice(&sliced(data, &shape, ranges), &out)))
}

fn sliced<T: Copy>(data: &[T], shape: &[i32], ranges: &[std::ops::Range<usize>]) -> Vec<T> {
    let n = shape.len();
    let mut strides = vec![1usize; n];
    for a in (0..n - 1).rev() {
        strides[a] = strides[a + 1] * shape[a + 1] as usize;
    }
    let mut out = Vec::with_capacity(ranges.iter().map(|r| r.len()).product());
    if out.capacity() == 0 {
        return out;
    }
    let last = &ranges[n - 1];
    // An index over every axis but the last, counted up like an odometer.
    let mut index: Vec<usize> = ranges[..n - 1].iter().map(|r| r.start).collect();
    loop {
        let base: usize = index.iter().zip(&strides).map(|(i, s)| i * s).sum();
        out.extend_from_slice(&data[base + last.start..base + last.end]);
        let mut axis = n - 1;
        loop {
            if axis == 0 {
                return out;
            }
            axis -= 1;
            index[axis] += 1;
            if index[axis] < ranges[axis].end {
                break;
            }
            index[axis] = ranges[axis].start;
        }
    }
}

/// x [B, H, S, D] with row r's new slots (`new` [B, H, n, D]) written into slots `slots[r]`
/// (a KV cache's write).
///
/// x is taken by value: when it alone holds its buffer (no other array, view or pending op can
/// see it, as MLX decides before it reuses an op's input for its output), the slots are written
/// into that buffer and x itself is returned; otherwise into a copy. A cache that copied itself
/// whole at every write spent a tenth of a batched decode step doing so.
pub fn put_slots(x: Array, new: &Array, slots: &[Vec<usize>]) -> Result<Array, Exception> {
    let n = slots.first().map_or(0, Vec::len);
    let host_dtype = matches!(x.dtype(), Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16);
    let fits = x.ndim() == 4 && new.ndim() == 4 && new.dtype() == x.dtype() && crate::route::on_cpu();
    if host_dtype && fits && sole_row_major_holder(&x)? {
        let new = row_major(new)?;
        if new.size() == 0 {
            return Ok(x);
        }
        let s = x.shape();
        let shape = [s[1] as usize, s[2] as usize, s[3] as usize];
        // SAFETY: x is evaluated, row-major and the only holder of its data (checked above), so
        // nothing reads the buffer while it is written; each pointer is to x's elements of the
        // width its dtype has.
        unsafe {
            match bits16(&new) {
                None => {
                    let data = mlx_sys::mlx_array_data_float32(x.as_ptr()) as *mut f32;
                    write_slots(std::slice::from_raw_parts_mut(data, x.size()), new.as_slice::<f32>(), shape, slots);
                }
                Some(added) => {
                    let data = mlx_sys::mlx_array_data_uint16(x.as_ptr()) as *mut u16;
                    write_slots(std::slice::from_raw_parts_mut(data, x.size()), added, shape, slots);
                }
            }
        }
        return Ok(x);
    }
    if !on_host(&x) || !fits {
        // Every row writing the same run of slots (a decode step, a batch in step): one slice
        // update, MLX's cheapest write, rather than a scatter.
        let start = slots.first().and_then(|row| row.first()).copied().unwrap_or(0);
        let run = |row: &Vec<usize>| row.iter().enumerate().all(|(j, &s)| s == start + j);
        if x.ndim() == 4 && slots.iter().all(run) && x.shape()[0] as usize == slots.len() {
            use mlx_rs::ops::indexing::TryIndexMutOp;
            let mut x = x;
            x.try_index_mut((.., .., start as i32..(start + n) as i32), new)?;
            return Ok(x);
        }
        let flat: Vec<i32> = slots.iter().flatten().map(|&s| s as i32).collect();
        let index = Array::from_slice(&flat, &[slots.len() as i32, 1, n as i32, 1]);
        return x.put_along_axis(&index, new, 2);
    }
    let (x, new) = (row_major(&x)?, row_major(new)?);
    let s = x.shape().to_vec();
    let shape = [s[1] as usize, s[2] as usize, s[3] as usize];
    Ok(with_elements!(x, |data| {
        let mut out = data.to_vec();
        write_slots(&mut out, new.as_slice(), shape, slots);
        Array::from_slice(&out, &s)
    }))
}

/// Writes row r's new slots `added` [B, H, n, D] into slots `slots[r]` of `data` [B, H, S, D]
/// (`[heads, total, d]` = [H, S, D]).
fn write_slots<T: Copy>(data: &mut [T], added: &[T], [heads, total, d]: [usize; 3], slots: &[Vec<usize>]) {
    let n = slots.first().map_or(0, Vec::len);
    for (r, row) in slots.iter().enumerate() {
        for h in 0..heads {
            for (t, &slot) in row.iter().enumerate() {
                let from = ((r * heads + h) * n + t) * d;
                let to = ((r * heads + h) * total + slot) * d;
                data[to..to + d].copy_from_slice(&added[from..from + d]);
            }
        }
    }
}

extern "C" {
    /// Whether the `mlx::core::array` at `array` alone holds its data: MLX's `is_donatable`
    /// (`scripts/native/donation_shim.cpp`).
    fn mlxrs_array_is_donatable(array: *mut std::ffi::c_void) -> bool;
}

/// Whether x, evaluated here, is laid out row-major and is the only holder of its buffer.
fn sole_row_major_holder(x: &Array) -> Result<bool, Exception> {
    x.eval()?;
    let mut contiguous = false;
    // SAFETY: `x` is a valid, evaluated array; the first call writes one bool, the second only
    // reads reference counts.
    unsafe {
        mlx_sys::_mlx_array_is_row_contiguous(&mut contiguous, x.as_ptr());
        Ok(contiguous && mlxrs_array_is_donatable(x.as_ptr().ctx))
    }
}

/// Slots 0..end of x [B, H, S, D]: a view of x's data, which MLX slices without copying and the
/// host's attention reads in place (a copy had cost O(context) per layer and step).
pub fn first_slots(x: &Array, end: usize) -> Result<Array, Exception> {
    use mlx_rs::ops::indexing::TryIndexOp;
    if x.ndim() == 4 && x.shape()[2] as usize == end {
        return Ok(x.clone());
    }
    x.try_index((.., .., ..end as i32))
}

/// [B, H, len, D] from x [B, H, S, D]: place j of row r holds slot `index[r·len + j]`, or zeros
/// where that is S (one past the last slot).
pub fn take_slots(x: &Array, index: &[i32], len: usize) -> Result<Array, Exception> {
    let s = x.shape().to_vec();
    if !on_host(x) || x.ndim() != 4 {
        let index = Array::from_slice(index, &[s[0], 1, len as i32, 1]);
        let zeros = Array::zeros::<f32>(&[s[0], s[1], 1, s[3]])?.as_dtype(x.dtype())?;
        let padded = mlx_rs::ops::concatenate(&[x, &zeros], 2)?;
        let index = mlx_rs::ops::broadcast_to(&index, &[s[0], s[1], len as i32, s[3]])?;
        return padded.take_along_axis(&index, 2);
    }
    let x = row_major(x)?;
    let (rows, heads, total, d) = (s[0] as usize, s[1] as usize, s[2] as usize, s[3] as usize);
    Ok(with_elements!(x, |data| {
        let mut out = vec![Default::default(); rows * heads * len * d];
        for r in 0..rows {
            for h in 0..heads {
                for j in 0..len {
                    let slot = index[r * len + j] as usize;
                    if slot < total {
                        let from = ((r * heads + h) * total + slot) * d;
                        let to = ((r * heads + h) * len + j) * d;
                        out[to..to + d].copy_from_slice(&data[from..from + d]);
                    }
                }
            }
        }
        Array::from_slice(&out, &[s[0], s[1], len as i32, s[3]])
    }))
}

/// One source of [`gather_slots`]: row `row` of an array [B, H, S, D], its slots `slots` in
/// that order (-1: a place of zeros).
pub struct SlotRun<'a> {
    pub array: &'a Array,
    pub row: usize,
    pub slots: &'a [i32],
}

/// [1, H, Σ slots, D]: every run's slots end to end along the slot axis, per head, in one copy
/// on the host (a tree's keys: a cache row's cached keys in position order, then its nodes').
/// The runs' arrays share a dtype, H and D.
pub fn gather_slots(runs: &[SlotRun]) -> Result<Array, Exception> {
    let Some(first) = runs.first() else { return Err(Exception::custom("gather_slots: no runs")) };
    let s = first.array.shape().to_vec();
    let fits = |r: &SlotRun| {
        let t = r.array.shape();
        r.array.dtype() == first.array.dtype()
            && t.len() == 4
            && (t[1], t[3]) == (s[1], s[3])
            && (r.row as i32) < t[0]
            && r.slots.iter().all(|&slot| slot < t[2])
    };
    if !runs.iter().all(fits) {
        return Err(Exception::custom("gather_slots: runs of other shapes or dtypes, or slots out of range"));
    }
    let len: usize = runs.iter().map(|r| r.slots.len()).sum();
    let floats = matches!(first.array.dtype(), Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16);
    if !(floats && crate::route::on_cpu()) {
        // Each run's slots (-1 reading an appended zero slot), then one concatenation.
        let parts = runs
            .iter()
            .map(|r| {
                let row = r.array.take_axis(Array::from_slice(&[r.row as i32], &[1]), 0)?;
                let total = r.array.shape()[2];
                let index: Vec<i32> = r.slots.iter().map(|&slot| if slot < 0 { total } else { slot }).collect();
                take_slots(&row, &index, index.len())
            })
            .collect::<Result<Vec<_>, Exception>>()?;
        return mlx_rs::ops::concatenate(&parts, 2);
    }
    let arrays = runs.iter().map(|r| row_major(r.array)).collect::<Result<Vec<_>, _>>()?;
    let (heads, d) = (s[1] as usize, s[3] as usize);
    Ok(with_elements!(arrays[0], |head| {
        // Typed after the first run's elements.
        let mut out = head[..0].to_vec();
        out.reserve(heads * len * d);
        let zeros = vec![Default::default(); d];
        for h in 0..heads {
            for (run, array) in runs.iter().zip(&arrays) {
                let data = array.as_slice();
                let total = array.shape()[2] as usize;
                let from = (run.row * heads + h) * total;
                for &slot in run.slots {
                    match usize::try_from(slot) {
                        Ok(slot) => out.extend_from_slice(&data[(from + slot) * d..(from + slot + 1) * d]),
                        Err(_) => out.extend_from_slice(&zeros),
                    }
                }
            }
        }
        Array::from_slice(&out, &[1, s[1], len as i32, s[3]])
    }))
}

/// Rows `ids` (integers, any shape) of a table [N, D], as [ids' shape…, D]: an embedding
/// lookup, copied on the host when the rows are few. Ids outside the table are left to MLX.
pub fn take_rows(table: &Array, ids: &Array) -> Result<Array, Exception> {
    let fits = table.ndim() == 2
        && matches!(table.dtype(), Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16)
        && matches!(ids.dtype(), Dtype::Int32 | Dtype::Uint32)
        && ids.size() * table.shape()[1] as usize <= HOST_ELEMENTS
        && crate::route::on_cpu();
    if !fits {
        return table.take_axis(ids, 0);
    }
    let ids = row_major(ids)?;
    let picked: Vec<usize> = match ids.dtype() {
        Dtype::Int32 => ids.as_slice::<i32>().iter().map(|&i| i as usize).collect(),
        _ => ids.as_slice::<u32>().iter().map(|&i| i as usize).collect(),
    };
    let (n, d) = (table.shape()[0] as usize, table.shape()[1] as usize);
    if picked.iter().any(|&i| i >= n) {
        return table.take_axis(&ids, 0);
    }
    let table = row_major(table)?;
    let mut shape = ids.shape().to_vec();
    shape.push(d as i32);
    Ok(with_elements!(table, |data| {
        let rows: Vec<_> = picked.iter().flat_map(|&i| &data[i * d..(i + 1) * d]).copied().collect();
        Array::from_slice(&rows, &shape)
    }))
}

/// `a + b` for arrays of one shape and dtype; anything else (broadcasting) is MLX's.
pub fn add(a: &Array, b: &Array) -> Result<Array, Exception> {
    if !on_host(a) || a.shape() != b.shape() || a.dtype() != b.dtype() {
        return a.add(b);
    }
    let (a, b) = (row_major(a)?, row_major(b)?);
    if let (Dtype::Bfloat16, Some(x), Some(y)) = (a.dtype(), bits16(&a), bits16(&b)) {
        return Ok(from_bits16(&bf16_elementwise(x, Bf16Op::Add(y)), a.shape(), a.dtype()));
    }
    let sums = with_floats(&a, |x| with_floats(&b, |y| x.iter().zip(y).map(|(x, y)| x + y).collect::<Vec<_>>()))??;
    Ok(rounded(&sums, a.shape(), a.dtype()))
}

/// `x · s` for a single-element `s` of x's dtype, rounded once to it.
pub fn scale(x: &Array, s: &Array) -> Result<Array, Exception> {
    if !on_host(x) || s.size() != 1 || s.dtype() != x.dtype() {
        return x.multiply(s);
    }
    let (x, s) = (row_major(x)?, row_major(s)?);
    let s = with_floats(&s, |s| s[0])?;
    if let (Dtype::Bfloat16, Some(bits)) = (x.dtype(), bits16(&x)) {
        return Ok(from_bits16(&bf16_elementwise(bits, Bf16Op::Scale(s)), x.shape(), x.dtype()));
    }
    let scaled = with_floats(&x, |x| x.iter().map(|v| v * s).collect::<Vec<_>>())?;
    Ok(rounded(&scaled, x.shape(), x.dtype()))
}

#[cfg(test)]
mod tests {
    use mlx_rs::random;

    use super::*;

    fn normal(shape: &[i32], seed: u64, dtype: Dtype) -> Array {
        let x = random::normal::<f32>(shape, None, None, &random::key(seed).unwrap()).unwrap();
        x.multiply(Array::from_f32(7.0)).unwrap().as_dtype(dtype).unwrap()
    }

    fn identical(a: &Array, b: &Array) -> bool {
        a.shape() == b.shape() && a.dtype() == b.dtype() && a.ne(b).unwrap().sum(None).unwrap().item_cast::<u32>() == 0
    }

    /// A gather of runs equals MLX's own: each run's row and slots taken (zeros for -1), then
    /// concatenated along the slots.
    #[test]
    fn gathered_slots_equal_mlxs_takes_and_concatenation() {
        use mlx_rs::ops::indexing::TryIndexOp;
        for dtype in [Dtype::Float32, Dtype::Bfloat16] {
            let cache = normal(&[3, 2, 10, 8], 1, dtype);
            let nodes = normal(&[5, 2, 1, 8], 2, dtype);
            let slots = [7, 8, -1, 2, 3];
            let runs = [
                SlotRun { array: &cache, row: 1, slots: &slots },
                SlotRun { array: &nodes, row: 4, slots: &[0] },
                SlotRun { array: &nodes, row: 2, slots: &[0] },
            ];
            let ours = gather_slots(&runs).unwrap();
            let zeros = Array::zeros::<f32>(&[1, 2, 1, 8]).unwrap().as_dtype(dtype).unwrap();
            let slot = |i: i32| cache.try_index((1..2, .., i..i + 1)).unwrap();
            let mut parts: Vec<Array> = slots.iter().map(|&i| if i < 0 { zeros.clone() } else { slot(i) }).collect();
            parts.push(nodes.try_index(4..5).unwrap());
            parts.push(nodes.try_index(2..3).unwrap());
            let mlx = mlx_rs::ops::concatenate(&parts, 2).unwrap();
            assert!(identical(&ours, &mlx), "{dtype:?}");
        }
    }

    #[test]
    fn equal_mlxs_ops_bit_for_bit() {
        for dtype in [Dtype::Float32, Dtype::Bfloat16, Dtype::Float16] {
            let (x, y) = (normal(&[2, 3, 4, 8], 1, dtype), normal(&[2, 3, 4, 8], 2, dtype));
            assert!(identical(&reshape(&x, &[2, 3, 32]).unwrap(), &x.reshape(&[2, 3, 32]).unwrap()), "{dtype:?}");
            let swapped = swap_axes_1_2(&x).unwrap();
            assert!(identical(&swapped, &x.transpose_axes(&[0, 2, 1, 3]).unwrap()), "{dtype:?}");
            assert!(identical(&swap_axes_1_2(&swapped).unwrap(), &x), "{dtype:?}");
            // Sums that round: values of very different sizes.
            let small = y.multiply(Array::from_f32(1e-3)).unwrap().as_dtype(dtype).unwrap();
            assert!(identical(&add(&x, &small).unwrap(), &x.add(&small).unwrap()), "{dtype:?}");
            assert!(identical(&add(&x, &y).unwrap(), &x.add(&y).unwrap()), "{dtype:?}");
            let third = x.take_axis(Array::from_int(2), 2).unwrap();
            assert!(identical(&index_axis_2(&x, 2).unwrap(), &third), "{dtype:?}");
            let z = normal(&[4, 3, 4, 8], 3, dtype);
            let rows_1_3 = z.take_axis(Array::from_slice(&[1, 2], &[2]), 0).unwrap();
            assert!(identical(&rows(&z, 1..3).unwrap(), &rows_1_3), "{dtype:?}");
            let joined = mlx_rs::ops::concatenate(&[&x, &z, &rows_1_3], 0).unwrap();
            assert!(identical(&concat(&[&x, &z, &rows_1_3], 0).unwrap(), &joined), "{dtype:?}");
            let wide = normal(&[2, 3, 5, 8], 8, dtype);
            for (axis, other) in [(2, &wide), (3, &normal(&[2, 3, 4, 3], 9, dtype))] {
                let joined = mlx_rs::ops::concatenate(&[&x, other, &y], axis as i32).unwrap();
                assert!(identical(&concat(&[&x, other, &y], axis).unwrap(), &joined), "{dtype:?}, axis {axis}");
            }
            use mlx_rs::ops::indexing::TryIndexOp;
            let part = wide.try_index((1..2, .., 1..4, 2..7)).unwrap();
            assert!(identical(&slice(&wide, &[1..2, 0..3, 1..4, 2..7]).unwrap(), &part), "{dtype:?}");
            let empty = wide.try_index((.., .., 2..2, ..)).unwrap();
            assert!(identical(&slice(&wide, &[0..2, 0..3, 2..2, 0..8]).unwrap(), &empty), "{dtype:?}");
            assert!(slice(&wide, &[0..2, 0..3, 0..6, 0..8]).is_err(), "{dtype:?}: past the end");
            // Slots: written, cut and gathered as MLX's ops do it.
            let cache = normal(&[2, 3, 6, 8], 4, dtype);
            let new = normal(&[2, 3, 2, 8], 5, dtype);
            let index = Array::from_slice(&[4, 1, 0, 5], &[2, 1, 2, 1]);
            let written = cache.put_along_axis(&index, &new, 2).unwrap();
            // Into a copy while `cache` holds the buffer too; in place into an array nothing else
            // holds.
            let once = put_slots(cache.clone(), &new, &[vec![4, 1], vec![0, 5]]).unwrap();
            assert!(identical(&once, &written), "{dtype:?}");
            assert!(!identical(&cache, &written), "{dtype:?}: the cache the copy came from changed");
            let sole = Array::from_slice(&[0f32; 2 * 3 * 6 * 8], &[2, 3, 6, 8]).as_dtype(dtype).unwrap();
            let sole = put_slots(sole, &cache, &[(0..6).collect(), (0..6).collect()]).unwrap();
            assert!(identical(&sole, &cache), "{dtype:?}");
            let before = sole.as_ptr().ctx;
            let again = put_slots(sole, &new, &[vec![4, 1], vec![0, 5]]).unwrap();
            assert_eq!(again.as_ptr().ctx, before, "{dtype:?}: written in place");
            assert!(identical(&again, &written), "{dtype:?}");
            // A view of the buffer keeps it from being written in place.
            let view = first_slots(&again, 3).unwrap();
            view.eval().unwrap();
            let seen = mlx_rs::ops::indexing::TryIndexOp::try_index(&written, (.., .., ..3)).unwrap();
            let third = put_slots(again, &normal(&[2, 3, 2, 8], 7, dtype), &[vec![0, 1], vec![0, 1]]).unwrap();
            assert!(identical(&view, &seen), "{dtype:?}: a view saw the write");
            assert!(!identical(&third, &written), "{dtype:?}");
            let cut = cache.take_axis(Array::from_slice(&[0, 1, 2], &[3]), 2).unwrap();
            assert!(identical(&first_slots(&cache, 3).unwrap(), &cut), "{dtype:?}");
            let order = [5, 6, 0, 2, 6, 1];
            let zeros = Array::zeros::<f32>(&[2, 3, 1, 8]).unwrap().as_dtype(dtype).unwrap();
            let padded = mlx_rs::ops::concatenate(&[&cache, &zeros], 2).unwrap();
            let at = mlx_rs::ops::broadcast_to(Array::from_slice(&order, &[2, 1, 3, 1]), &[2, 3, 3, 8]).unwrap();
            let gathered = padded.take_along_axis(&at, 2).unwrap();
            assert!(identical(&take_slots(&cache, &order, 3).unwrap(), &gathered), "{dtype:?}");
            let ids = Array::from_slice(&[3i32, 0, 5, 3], &[2, 2]);
            let table = normal(&[6, 8], 6, dtype);
            assert!(identical(&take_rows(&table, &ids).unwrap(), &table.take_axis(&ids, 0).unwrap()), "{dtype:?}");
            let s = Array::from_f32(0.37).as_dtype(dtype).unwrap().reshape(&[1]).unwrap();
            assert!(identical(&scale(&x, &s).unwrap(), &x.multiply(&s).unwrap()), "{dtype:?}");
        }
    }
}

//! Attention over host arrays in float32 and half precision: MLX's CPU steps and roundings, with
//! the two products and the softmax through this crate's loops.

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

use crate::arrays::{round_to, rounded, row_major, scalar, with_floats, with_round, Round};
use crate::softmax::softmax_row;
use crate::weight::Floats;
use crate::{bits16, helper};

/// Attention of queries q [B, Hq, L, D] over the first `slots` slots of keys/values
/// [B, Hkv, S, D], where the CPU route covers it (float32 or half precision); `None` for MLX's
/// ops.
pub fn attention_over_slots(
    q: &Array,
    k: &Array,
    v: &Array,
    slots: usize,
    scale: f32,
    mask: &Mask,
) -> Result<Option<Array>, Exception> {
    if !(matches!(q.dtype(), Dtype::Bfloat16 | Dtype::Float16 | Dtype::Float32) && crate::route::on_cpu()) {
        return Ok(None);
    }
    host_attention(q, k, v, slots, scale, mask)
}

/// Attention of row b of queries q [B, Hq, L, D] over row b's own keys and values, where the
/// CPU route covers it (half precision); `None` for MLX's ops.
pub fn attention_rows(q: &Array, rows: &[RowKeys], scale: f32) -> Result<Option<Array>, Exception> {
    if !(matches!(q.dtype(), Dtype::Bfloat16 | Dtype::Float16) && crate::route::on_cpu()) {
        return Ok(None);
    }
    half_attention_rows(q, rows, scale)
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

/// MLX's CPU attention (its fallback in mlx/fast.cpp: scale q, q·kᵀ, mask with the dtype's
/// lowest value, precise softmax, ·v, every step rounded to the dtype), with the two products
/// through the host's loops instead of MLX's generic kernel (half precision) or BLAS (float32):
/// the same roundings, the sums in another order, a query's result independent of how many
/// queries share the call, over the first `s` slots of k and v. `None` where the loops do not
/// apply.
///
/// In float32 the gain is the softmax: MLX's computes its exponentials one element at a time,
/// which took about a third of a 512-token prefill of the 40M bench model, on one thread.
///
/// The products read the arrays' data per head directly rather than slicing them with MLX ops:
/// a decode step of a small model is bound by the count of MLX ops, each costing microseconds
/// of dispatch on the CPU.
fn host_attention(
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
            keys: keys.from(r * k.row),
            values: values.from(r * v.row),
            key_heads: k.head,
            value_heads: v.head,
            s,
        })
        .collect();
    attention_core(q, &rows, hkv as usize, scale, Masks::Shared(mask)).map(Some)
}

/// A float32 or half-precision [B, H, S, D] array (evaluated) whose slots are each D contiguous
/// values and whose heads each hold their S slots in a run (row-major, or a slice of a
/// row-major array along S, as a KV cache's first slots are), with its strides (in elements) of
/// a row and of a head.
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

    /// The data from the first element to the last.
    fn data(&self) -> Floats<'_> {
        let shape = self.array.shape();
        let [b, h, s, d] = [0, 1, 2, 3].map(|i| shape[i] as usize);
        let span = if b * h * s * d == 0 { 0 } else { (b - 1) * self.row + (h - 1) * self.head + s * d };
        let a = self.array.as_ptr();
        // SAFETY: the array is evaluated and of the dtype read; its last element lies `span − 1`
        // elements after its first, within its buffer, which it keeps alive while the slice
        // borrows it. An empty array is read as an empty slice, from no pointer.
        unsafe {
            match self.array.dtype() {
                _ if span == 0 => Floats::F32(&[]),
                Dtype::Float32 => Floats::F32(std::slice::from_raw_parts(mlx_sys::mlx_array_data_float32(a), span)),
                Dtype::Bfloat16 => Floats::Bf16(std::slice::from_raw_parts(mlx_sys::mlx_array_data_uint16(a), span)),
                _ => Floats::F16(std::slice::from_raw_parts(mlx_sys::mlx_array_data_uint16(a), span)),
            }
        }
    }
}

/// A row's keys and values for [`half_attention_rows`]: one piece read where it lies (row r of
/// it), or several copied end to end per KV head, with their count of keys.
enum Held {
    InPlace(InPlace, InPlace, usize),
    Gathered(Vec<u16>, Vec<u16>, usize),
}

/// [`attention_rows`] through the host's loops (half precision): a row of one piece read in
/// place (a drafter's context with its block in the free slots, `LayerContext::with_block`), a
/// row of several pieces copied end to end per KV head; then [`attention_core`]. `None` where
/// the loops do not apply.
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
    let half = |bits| if dtype == Dtype::Bfloat16 { Floats::Bf16(bits) } else { Floats::F16(bits) };
    let data: Vec<RowData> = held
        .iter()
        .map(|held| match held {
            Held::InPlace(k, v, r) => RowData {
                keys: k.data().from(r * k.row),
                values: v.data().from(r * v.row),
                key_heads: k.head,
                value_heads: v.head,
                s: k.array.shape()[2] as usize,
            },
            Held::Gathered(keys, values, s) => {
                RowData { keys: half(keys), values: half(values), key_heads: *s * d, value_heads: *s * d, s: *s }
            }
        })
        .collect();
    let masks: Vec<&Mask> = rows.iter().map(|r| &r.mask).collect();
    attention_core(q, &data, hkv, scale, Masks::PerRow(&masks)).map(Some)
}

/// One row's keys and values, [Hkv, s, D].
struct RowData<'a> {
    /// From the row's first key; head g's s keys start `key_heads · g` values in.
    keys: Floats<'a>,
    values: Floats<'a>,
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

impl Keys<'_> {
    /// The keys from the first read to the last, of `s`; all of them for a query that reads
    /// none, whose softmax is then MLX's over every masked score.
    fn span(&self, s: usize) -> std::ops::Range<usize> {
        let span = match self {
            Keys::First(n) => 0..*n,
            Keys::Marked(marks) => match (marks.iter().position(|&m| m), marks.iter().rposition(|&m| m)) {
                (Some(first), Some(last)) => first..last + 1,
                _ => 0..0,
            },
        };
        if span.is_empty() {
            0..s
        } else {
            span
        }
    }
}

/// The dtype's lowest finite value, with which MLX masks scores.
fn lowest(dtype: Dtype) -> f32 {
    match dtype {
        Dtype::Bfloat16 => f32::from_bits(0xFF7F_0000),
        Dtype::Float16 => f32::from_bits(0xC77F_E000),
        _ => f32::MIN,
    }
}

/// One mask for every row (rows of equal length), or one per row.
enum Masks<'a> {
    Shared(&'a Mask),
    PerRow(&'a [&'a Mask]),
}

/// The steps of [`host_attention`] for queries q [B, Hq, L, D] over each row's keys and values.
/// q is scaled here as MLX's multiply does it (both in the dtype, the product rounded to it).
/// The softmax is MLX's, computed on the host ([`softmax_row`]) for every mask but an additive
/// one.
fn attention_core(q: &Array, rows: &[RowData], hkv: usize, scale: f32, masks: Masks) -> Result<Array, Exception> {
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
/// so the split changes no result. With the demo target's sliding layers (4 query heads over
/// one KV head of dimension 64), this is one query over 64 keys: from there on the split is
/// clearly faster, and more so the more keys and queries; below it, over 32 keys, handing half
/// over costs about what it saves.
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

impl Segment {
    /// The segment cut into runs of at most `len` queries.
    fn runs(&self, len: usize) -> impl Iterator<Item = Segment> + '_ {
        (self.from..self.to).step_by(len).map(move |from| Segment {
            from,
            to: (from + len).min(self.to),
            row: self.row,
            head: self.head,
        })
    }
}

/// Queries whose scores are computed together, over the keys any of them reads: enough for the
/// product loops' register tiles to reuse each key several times, few enough that a causal
/// prefill's runs skip most of the keys their queries do not read.
const QUERY_RUN: usize = 24;

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

    /// Scores of a segment's queries over keys `span` [to − from, span.len()]: q scaled as MLX's
    /// multiply does it (both in the dtype, the product rounded to it), times the row's keys of
    /// its KV head. A key's score is its own dot product, the same whatever the span.
    fn scores(&self, segment: &Segment, span: std::ops::Range<usize>, scores: &mut Vec<f32>) {
        use crate::dot;
        let (row, d, dtype) = (&self.rows[segment.row], self.d, self.dtype);
        let n = segment.to - segment.from;
        let mut x = vec![0f32; n * d];
        with_round!(dtype, |r| {
            for (x, &v) in x.iter_mut().zip(&self.qs[segment.from * d..segment.to * d]) {
                *x = r.round(v * self.scale);
            }
        });
        let at = scores.len();
        let width = span.len();
        scores.resize(at + n * width, 0.0);
        let keys = row.keys.range(segment.head * row.key_heads + span.start * d, width * d).weight();
        dot::product(&x, dtype, n, d, keys, 0..width, width, &mut scores[at..]);
    }

    /// A segment's output rows: its probabilities over keys `span` [to − from, span.len()] times
    /// those keys' values.
    fn weighted_sums(&self, segment: &Segment, span: std::ops::Range<usize>, ps: &[f32], out: &mut [f32]) {
        let (row, d) = (&self.rows[segment.row], self.d);
        let values = row.values.range(segment.head * row.value_heads + span.start * d, span.len() * d);
        crate::weighted_sum::weighted_sum(ps, segment.to - segment.from, span.len(), values, d, out);
    }

    /// Queries `range` whose masks the host reads, their output rows into `out`: scores, masked
    /// as MLX masks (the dtype's lowest value), MLX's softmax, then the values.
    ///
    /// Queries go [`QUERY_RUN`] at a time over the keys any of them reads (a causal prefill's
    /// early queries read few keys, a sliding window's read a band): a key outside that span has
    /// probability zero for each of them, and the softmax's sum and the weighted sums take
    /// their terms in key order, where a zero adds nothing, so each query's result is what
    /// it is over all the keys.
    fn attend(&self, range: std::ops::Range<usize>, visibility: &[(&Visible, usize)], out: &mut [f32]) {
        let lowest = lowest(self.dtype);
        let mut ps = Vec::new();
        for segment in self.segments(range.clone()) {
            let s = self.rows[segment.row].s;
            let (visible, b) = visibility[segment.row];
            for run in segment.runs(QUERY_RUN) {
                let keys: Vec<Keys> = (run.from..run.to)
                    .map(|f| {
                        // The query's place in its row: head h, position i.
                        let within = f - run.row * self.hkv * self.block;
                        visible.keys([b, within / self.l, within % self.l], self.l, s)
                    })
                    .collect();
                let span = keys.iter().map(|k| k.span(s)).reduce(|a, b| a.start.min(b.start)..a.end.max(b.end));
                let span = span.unwrap_or(0..s);
                let width = span.len();
                ps.clear();
                self.scores(&run, span.clone(), &mut ps);
                for (keys, scores) in keys.iter().zip(ps.chunks_exact_mut(width.max(1))) {
                    with_round!(self.dtype, |r| match keys {
                        Keys::First(n) => {
                            let n = n - span.start;
                            scores[..n].iter_mut().for_each(|v| *v = r.round(*v));
                            scores[n..].fill(lowest);
                        }
                        Keys::Marked(marks) => {
                            for (v, &seen) in scores.iter_mut().zip(&marks[span.clone()]) {
                                *v = if seen { r.round(*v) } else { lowest };
                            }
                        }
                    });
                    softmax_row(self.dtype, scores);
                }
                let d = self.d;
                let out = &mut out[(run.from - range.start) * d..(run.to - range.start) * d];
                self.weighted_sums(&run, span, &ps, out);
            }
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
        helper::join(|| self.attend(0..half, visibility, first), || self.attend(half..self.len(), visibility, second));
    }

    /// Every query under additive masks: the host's scores, MLX's masking and softmax (one op
    /// over every row when they share a mask, else one per row, evaluated together), then the
    /// host's weighted sums.
    fn attend_additive(&self, masks: Masks, out: &mut [f32]) -> Result<(), Exception> {
        let (dtype, l) = (self.dtype, self.l as i32);
        let hq = (self.block / self.l * self.hkv) as i32;
        let mut scores = Vec::new();
        for segment in self.segments(0..self.len()) {
            self.scores(&segment, 0..self.rows[segment.row].s, &mut scores);
        }
        let lowest = scalar(lowest(dtype), dtype)?;
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
            let all = 0..self.rows[segment.row].s;
            self.weighted_sums(&segment, all, &ps[at..at + n], &mut out[segment.from * self.d..segment.to * self.d]);
            at += n;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first slots of a larger cache (a view) are read where they lie, not copied.
    #[test]
    fn reads_a_caches_first_slots_in_place() {
        let k = mlx_rs::random::normal::<f32>(&[2, 2, 48, 64], None, None, &mlx_rs::random::key(2).unwrap()).unwrap();
        let k = crate::layout::first_slots(&k.as_dtype(Dtype::Bfloat16).unwrap(), 37).unwrap();
        let view = InPlace::of(&k).unwrap();
        let strides = [view.row, view.head];
        assert_eq!((view.array.shape(), strides), (&[2, 2, 37, 64][..], [2 * 48 * 64, 48 * 64]), "not read in place");
    }
}

//! KV caches of one row: a growing cache for full-attention layers and a ring for sliding
//! layers. Both roll back the last rows written exactly, also across the ring's wrap: the
//! ring holds `window + slack` slots, so rows rolled back never overwrote a row that is still
//! inside the window afterwards, and every slot records which position it holds.

use kernels::dot::SUM_PERIOD;
use mlx_rs::error::Exception;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::Array;
use plugin_api::nn::layout::{put_slots, take_slots};
use plugin_api::nn::ops::Mask;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CacheError {
    #[error("cannot roll back {requested} rows: {limit}")]
    Rollback { requested: usize, limit: String },
}

/// Rows a full cache grows by at a time.
const GROWTH: usize = 256;

/// Cloning is cheap (arrays are shared) and safe: every write makes new arrays.
#[derive(Clone)]
pub struct LayerCache {
    /// The attention window for sliding layers; `None` for full attention.
    window: Option<usize>,
    /// Extra ring slots beyond the window: the most rows that can be rolled back.
    slack: usize,
    /// [B, H, slots, D].
    keys: Option<Array>,
    values: Option<Array>,
    /// Per row, the position each slot holds (-1 when empty).
    slot_positions: Vec<Vec<i32>>,
    /// Per row, the next position to write.
    offsets: Vec<usize>,
}

/// What attention over the cache needs after a write: the first `slots` slots of keys and
/// values [B, H, S, D] (S ≥ slots), under `mask` [.., slots].
pub struct Fetched {
    pub keys: Array,
    pub values: Array,
    pub slots: usize,
    pub mask: Mask,
}

impl LayerCache {
    /// A growing cache for a full-attention layer, for `rows` rows.
    pub fn full(rows: usize) -> LayerCache {
        LayerCache {
            window: None,
            slack: 0,
            keys: None,
            values: None,
            slot_positions: vec![Vec::new(); rows],
            offsets: vec![0; rows],
        }
    }

    /// A ring for a sliding window that can roll back up to `slack` rows.
    pub fn sliding(rows: usize, window: usize, slack: usize) -> LayerCache {
        LayerCache {
            window: Some(window),
            slack,
            keys: None,
            values: None,
            slot_positions: vec![Vec::new(); rows],
            offsets: vec![0; rows],
        }
    }

    /// Bytes of keys and values held.
    pub fn nbytes(&self) -> usize {
        self.keys.iter().chain(&self.values).map(|a| a.nbytes()).sum()
    }

    pub fn rows(&self) -> usize {
        self.offsets.len()
    }

    /// The next position of each row.
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// The keys, values and per-row slot positions as stored (for read-only views).
    pub fn storage(&self) -> Option<(&Array, &Array, &[Vec<i32>])> {
        Some((self.keys.as_ref()?, self.values.as_ref()?, &self.slot_positions))
    }

    /// Writes keys/values [B, H, L, D], row r at positions offsets[r]..offsets[r]+L, and
    /// returns what attention of those queries reads.
    pub fn write(&mut self, keys: &Array, values: &Array) -> Result<Fetched, Exception> {
        let new = keys.shape()[2] as usize;
        match self.window {
            None => self.write_full(keys, values, new),
            Some(window) => self.write_ring(keys, values, new, window),
        }
    }

    /// Writes keys/values [B, H, L, D] as [`write`](Self::write) does, for nothing to read them
    /// now: a tree's accepted path, whose nodes read the cache beside it.
    pub fn append(&mut self, keys: &Array, values: &Array) -> Result<(), Exception> {
        let new = keys.shape()[2] as usize;
        match self.window {
            None => self.store_full(keys, values, new).map(|_| ()),
            Some(window) => {
                self.ensure_capacity(keys, values, window + self.slack)?;
                self.store_ring(keys, values, new, window + self.slack)
            }
        }
    }

    /// What the cache holds for each row, as the nodes of a tree of drafts read it
    /// ([`Prefix`]); nothing is written or copied. None before the first write.
    pub fn prefix(&self) -> Option<Prefix> {
        let (Some(keys), Some(values)) = (&self.keys, &self.values) else { return None };
        let mut rows = Vec::with_capacity(self.rows());
        for (r, &offset) in self.offsets.iter().enumerate() {
            // A full cache holds position p at slot p; a ring, where `slot_positions` says.
            let held: Vec<(usize, i32)> = match self.window {
                None => (0..offset).map(|p| (p, p as i32)).collect(),
                Some(_) => self.slot_positions[r].iter().copied().enumerate().filter(|&(_, p)| p >= 0).collect(),
            };
            // The places from the first (a multiple of the period) to the row's last position:
            // the next key, at `offset`, follows them.
            let base = held.iter().map(|&(_, p)| p).min().map_or(offset as i32, |p| p - p % PERIOD);
            let len = (offset as i32 - base).max(0) as usize;
            let mut slots = vec![-1; len];
            let mut positions = vec![-1; len];
            for (slot, p) in held {
                let j = (p - base) as usize;
                if j < len {
                    slots[j] = slot as i32;
                    positions[j] = p;
                }
            }
            rows.push(PrefixRow { slots, positions });
        }
        Some(Prefix { window: self.window, keys: keys.clone(), values: values.clone(), rows })
    }

    /// Forgets the last `n[r]` positions written to row r.
    pub fn rollback(&mut self, n: &[usize]) -> Result<(), CacheError> {
        for (r, &n) in n.iter().enumerate() {
            let offset = self.offsets[r];
            if n > offset {
                return Err(CacheError::Rollback { requested: n, limit: format!("row {r} caches only {offset} rows") });
            }
            if self.window.is_some() && n > self.slack && offset > self.ring_capacity() {
                return Err(CacheError::Rollback {
                    requested: n,
                    limit: format!("the ring keeps {} rows beyond its window", self.slack),
                });
            }
        }
        for (r, &n) in n.iter().enumerate() {
            for position in self.offsets[r] - n..self.offsets[r] {
                let slot = self.slot_of(position);
                if self.slot_positions[r].get(slot) == Some(&(position as i32)) {
                    self.slot_positions[r][slot] = -1;
                }
            }
            self.offsets[r] -= n;
        }
        Ok(())
    }

    /// Keeps only the listed rows, in that order.
    pub fn filter_rows(&mut self, keep: &[usize]) -> Result<(), Exception> {
        let index = Array::from_slice(&keep.iter().map(|&r| r as i32).collect::<Vec<_>>(), &[keep.len() as i32]);
        self.keys = self.keys.take().map(|k| k.take_axis(&index, 0)).transpose()?;
        self.values = self.values.take().map(|v| v.take_axis(&index, 0)).transpose()?;
        self.slot_positions = keep.iter().map(|&r| self.slot_positions[r].clone()).collect();
        self.offsets = keep.iter().map(|&r| self.offsets[r]).collect();
        Ok(())
    }

    /// One cache holding the rows of `parts` in order (all of the same kind). Parts with
    /// nothing written yet (an empty prefill) join as empty rows.
    pub fn stack(parts: Vec<LayerCache>) -> Result<LayerCache, Exception> {
        let first = parts.first().expect("at least one cache");
        let (window, slack) = (first.window, first.slack);
        let slots = parts.iter().map(|p| p.slot_positions.first().map_or(0, Vec::len)).max().unwrap_or(0);
        let template = parts.iter().find_map(|p| p.keys.as_ref().map(|k| (k.shape().to_vec(), k.dtype())));
        let (mut keys, mut values, mut slot_positions, mut offsets) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for mut part in parts {
            let rows = part.rows();
            match (part.keys.take(), part.values.take(), &template) {
                (Some(k), Some(v), _) => {
                    let have = k.shape()[2] as usize;
                    keys.push(pad_slots(&k, slots - have)?);
                    values.push(pad_slots(&v, slots - have)?);
                }
                (_, _, Some((shape, dtype))) => {
                    let empty =
                        Array::zeros::<f32>(&[rows as i32, shape[1], slots as i32, shape[3]])?.as_dtype(*dtype)?;
                    keys.push(empty.clone());
                    values.push(empty);
                }
                _ => {}
            }
            for mut row in part.slot_positions {
                row.resize(slots, -1);
                slot_positions.push(row);
            }
            offsets.extend(part.offsets);
        }
        let cat = |a: &[Array]| if a.is_empty() { Ok(None) } else { mlx_rs::ops::concatenate(a, 0).map(Some) };
        Ok(LayerCache { window, slack, keys: cat(&keys)?, values: cat(&values)?, slot_positions, offsets })
    }

    fn ring_capacity(&self) -> usize {
        self.window.map_or(usize::MAX, |w| w + self.slack)
    }

    fn slot_of(&self, position: usize) -> usize {
        match self.window {
            None => position,
            Some(_) => position % self.ring_capacity(),
        }
    }

    fn write_full(&mut self, keys: &Array, values: &Array, new: usize) -> Result<Fetched, Exception> {
        let end = self.store_full(keys, values, new)?;
        // Keys are in position order: attention reads the slots up to the furthest row, where
        // the storage holds them.
        let (keys, values) = (self.keys.clone().unwrap(), self.values.clone().unwrap());
        // One row's keys are exactly positions 0..end: the usual causal mask.
        let mask = match (self.rows(), new) {
            (1, 1) => Mask::All,
            (1, _) => Mask::Causal,
            _ => Mask::Array(self.mask(new, end, None)?),
        };
        Ok(Fetched { keys, values, slots: end, mask })
    }

    /// Stores the new rows of a full cache at their positions; the furthest row's end.
    fn store_full(&mut self, keys: &Array, values: &Array, new: usize) -> Result<usize, Exception> {
        let end = self.offsets.iter().map(|o| o + new).max().unwrap_or(new);
        self.ensure_capacity(keys, values, end.div_ceil(GROWTH) * GROWTH)?;
        let slots: Vec<Vec<usize>> = self.offsets.iter().map(|&o| (o..o + new).collect()).collect();
        self.store(keys, values, &slots)?;
        for (r, row) in slots.iter().enumerate() {
            for &p in row {
                self.slot_positions[r][p] = p as i32;
            }
            self.offsets[r] += new;
        }
        Ok(end)
    }

    fn write_ring(&mut self, keys: &Array, values: &Array, new: usize, window: usize) -> Result<Fetched, Exception> {
        let capacity = window + self.slack;
        self.ensure_capacity(keys, values, capacity)?;
        let starts = self.offsets.clone();
        let new_positions: Vec<Vec<i32>> = starts.iter().map(|&o| (o..o + new).map(|p| p as i32).collect()).collect();
        let empty = self.slot_positions.iter().all(|row| row.iter().all(|&p| p < 0));
        let (all_k, all_v, positions) = if !empty && new <= self.slack + 1 {
            // The common case (decode steps, verify windows): the ring holds the new rows beside
            // the window before them.
            self.store_ring(keys, values, new, capacity)?;
            (self.keys.clone().unwrap(), self.values.clone().unwrap(), self.slot_positions.clone())
        } else {
            // Queries of this write read the window before their own position. When the write
            // is longer than the ring can hold alongside that window, attend over the ring as
            // it was followed by all new rows, then keep the newest rows in the ring.
            let read = if empty {
                (keys.clone(), values.clone(), new_positions.clone())
            } else {
                let mut positions = self.slot_positions.clone();
                for (row, new_row) in positions.iter_mut().zip(&new_positions) {
                    row.extend(new_row);
                }
                let all_k = mlx_rs::ops::concatenate(&[self.keys.as_ref().unwrap(), keys], 2)?;
                let all_v = mlx_rs::ops::concatenate(&[self.values.as_ref().unwrap(), values], 2)?;
                (all_k, all_v, positions)
            };
            self.store_ring(keys, values, new, capacity)?;
            read
        };
        let (keys, values, positions) = in_position_order(all_k, all_v, &positions)?;
        let single_row_causal = positions.len() == 1 && positions[0] == new_positions[0] && new <= window;
        let mask = if single_row_causal {
            // Exactly the new keys of one row, within the window: the usual causal mask.
            if new == 1 {
                Mask::All
            } else {
                Mask::Causal
            }
        } else if new == 1
            && positions
                .iter()
                .zip(&starts)
                .all(|(row, &q)| row.iter().all(|&p| p >= 0 && (p as usize) <= q && q - (p as usize) < window))
        {
            // Every key visible to the one query of each row (a decode step over a full
            // window): no mask, which MLX's attention computes faster.
            Mask::All
        } else {
            Mask::Array(position_mask(&positions, &starts, new, Some(window))?)
        };
        let slots = positions.first().map_or(0, Vec::len);
        Ok(Fetched { keys, values, slots, mask })
    }

    /// Writes the newest min(new, capacity) rows of each row into their ring slots.
    fn store_ring(&mut self, keys: &Array, values: &Array, new: usize, capacity: usize) -> Result<(), Exception> {
        let kept = new.min(capacity);
        let (keys, values) =
            if kept < new { (tail(keys, kept)?, tail(values, kept)?) } else { (keys.clone(), values.clone()) };
        let positions: Vec<Vec<usize>> = self.offsets.iter().map(|&o| (o + new - kept..o + new).collect()).collect();
        let slots: Vec<Vec<usize>> = positions.iter().map(|row| row.iter().map(|p| p % capacity).collect()).collect();
        self.store(&keys, &values, &slots)?;
        for (r, row) in positions.iter().enumerate() {
            for &p in row {
                self.slot_positions[r][p % capacity] = p as i32;
            }
            self.offsets[r] += new;
        }
        Ok(())
    }

    /// Scatters rows [B, H, n, D] into slots[r] of row r.
    fn store(&mut self, keys: &Array, values: &Array, slots: &[Vec<usize>]) -> Result<(), Exception> {
        self.keys = Some(put_slots(self.keys.take().unwrap(), keys, slots)?);
        self.values = Some(put_slots(self.values.take().unwrap(), values, slots)?);
        Ok(())
    }

    /// [B, 1, new, slots] mask of the queries just written over the first `slots` slots.
    fn mask(&self, new: usize, slots: usize, window: Option<usize>) -> Result<Array, Exception> {
        let positions: Vec<Vec<i32>> = self.slot_positions.iter().map(|row| row[..slots].to_vec()).collect();
        let starts: Vec<usize> = self.offsets.iter().map(|&o| o - new).collect();
        position_mask(&positions, &starts, new, window)
    }

    /// Makes room for `slots` slots per row, keeping what is stored.
    fn ensure_capacity(&mut self, keys: &Array, values: &Array, slots: usize) -> Result<(), Exception> {
        let have = self.slot_positions.first().map_or(0, Vec::len);
        if have >= slots && self.keys.is_some() {
            return Ok(());
        }
        let grow = |stored: Option<&Array>, like: &Array| -> Result<Array, Exception> {
            match stored {
                None => {
                    let s = like.shape();
                    Array::zeros::<f32>(&[s[0], s[1], slots as i32, s[3]])?.as_dtype(like.dtype())
                }
                Some(old) => pad_slots(old, slots - have),
            }
        };
        self.keys = Some(grow(self.keys.as_ref(), keys)?);
        self.values = Some(grow(self.values.as_ref(), values)?);
        for row in &mut self.slot_positions {
            row.resize(slots, -1);
        }
        Ok(())
    }
}

/// A cache's rows as a tree's nodes read them ([`LayerCache::prefix`]): per row, the keys and
/// values [1, H, len, D] in position order, laid out as a decode step reads them (from a
/// multiple of [`PERIOD`]) up to the row's last position, so that the next positions' keys
/// follow them in order.
pub struct Prefix {
    /// The attention window for sliding layers.
    pub window: Option<usize>,
    /// The cache's storage [B, Hkv, slots, D], as it holds them.
    pub keys: Array,
    pub values: Array,
    pub rows: Vec<PrefixRow>,
}

pub struct PrefixRow {
    /// The storage slot of each place, in position order (-1: none, read as zeros).
    pub slots: Vec<i32>,
    /// The position each place holds (-1: none).
    pub positions: Vec<i32>,
}

impl PrefixRow {
    /// Which slots a query at `position` reads: positions before it, within the window.
    pub fn visible(&self, position: i32, window: Option<usize>) -> impl Iterator<Item = bool> + '_ {
        self.positions.iter().map(move |&p| p >= 0 && p < position && window.is_none_or(|w| position - p < w as i32))
    }
}

/// The period of the products' sums (`kernels::dot::SUM_PERIOD`).
const PERIOD: i32 = SUM_PERIOD as i32;

/// Keys and values [B, H, S, D] whose slot s of row r holds position `positions[r][s]` (-1:
/// empty), rearranged so that slot j of row r holds position base_r + j, base_r a multiple
/// of [`PERIOD`] (empty positions are zeros), with the positions each slot now holds. Only
/// the first slots, one per position returned, count: the arrays may hold more.
///
/// Attention sums over the slots, where each term goes depending on its slot modulo
/// [`PERIOD`] (see `kernels::dot`). In this order a key's lane and its place among the keys
/// it is summed with depend on positions alone, not on where a ring of some capacity happened
/// to store it, nor on how many masked slots surround it. So a query gets the same result
/// bit for bit in a decode step, in a verify window of any length, and in a prefill: the
/// guarantee behind speculative output equal to plain decoding's in half precision.
fn in_position_order(
    keys: Array,
    values: Array,
    positions: &[Vec<i32>],
) -> Result<(Array, Array, Vec<Vec<i32>>), Exception> {
    let slots = positions.first().map_or(0, Vec::len);
    let bases: Vec<i32> = positions
        .iter()
        .map(|row| row.iter().copied().filter(|&p| p >= 0).min().map_or(0, |p| p - p % PERIOD))
        .collect();
    let len = positions
        .iter()
        .zip(&bases)
        .map(|(row, &base)| row.iter().copied().max().map_or(0, |p| (p - base + 1).max(0)))
        .max()
        .unwrap_or(0) as usize;
    // The slot each ordered place reads (`slots`: an appended zero slot).
    let mut index = vec![slots as i32; positions.len() * len];
    let mut ordered = vec![vec![-1; len]; positions.len()];
    for (r, (row, &base)) in positions.iter().zip(&bases).enumerate() {
        for (s, &p) in row.iter().enumerate().filter(|(_, &p)| p >= 0) {
            let j = (p - base) as usize;
            index[r * len + j] = s as i32;
            ordered[r][j] = p;
        }
    }
    // Already in order up to `len` (a ring before it wraps): attention reads those slots where
    // they lie, which spares a copy on the CPU and a gather on a device.
    let in_order = len <= slots && (0..positions.len()).all(|r| (0..len).all(|j| index[r * len + j] == j as i32));
    if in_order {
        return Ok((keys, values, ordered));
    }
    Ok((take_slots(&keys, &index, len)?, take_slots(&values, &index, len)?, ordered))
}

/// `a` [B, H, S, D] with `extra` empty slots appended.
fn pad_slots(a: &Array, extra: usize) -> Result<Array, Exception> {
    if extra == 0 {
        return Ok(a.clone());
    }
    let s = a.shape();
    let zeros = Array::zeros::<f32>(&[s[0], s[1], extra as i32, s[3]])?.as_dtype(a.dtype())?;
    mlx_rs::ops::concatenate(&[a, &zeros], 2)
}

fn tail(a: &Array, len: usize) -> Result<Array, Exception> {
    let total = a.shape()[2];
    a.try_index((.., .., total - len as i32..))
}

/// [B, 1, new, slots]: in row r, the query at position starts[r] + j sees a slot holding
/// position p when 0 <= p <= q and, in a window w, q - p < w.
fn position_mask(
    slot_positions: &[Vec<i32>],
    starts: &[usize],
    new: usize,
    window: Option<usize>,
) -> Result<Array, Exception> {
    let slots = slot_positions.first().map_or(0, Vec::len);
    let mut mask = Vec::with_capacity(slot_positions.len() * new * slots);
    for (row, &start) in slot_positions.iter().zip(starts) {
        for q in start..start + new {
            let q = q as i64;
            for &p in row {
                let p = p as i64;
                mask.push(p >= 0 && p <= q && window.is_none_or(|w| q - p < w as i64));
            }
        }
    }
    Ok(Array::from_slice(&mask, &[slot_positions.len() as i32, 1, new as i32, slots as i32]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops::indexing::IndexOp;

    /// Keys whose every element is its position + 1, so attention inputs can be read back
    /// (and empty slots, zeros, told apart).
    fn rows(start: usize, n: usize) -> Array {
        let data: Vec<f32> = (start..start + n).flat_map(|p| [p as f32 + 1.0, p as f32 + 1.0]).collect();
        Array::from_slice(&data, &[1, 1, n as i32, 2])
    }

    /// Keys for B rows, row r holding positions starts[r].. (each element its position).
    fn batch(starts: &[usize], n: usize) -> Array {
        let data: Vec<f32> =
            starts.iter().flat_map(|&s| (s..s + n).flat_map(|p| [p as f32 + 1.0, p as f32 + 1.0])).collect();
        Array::from_slice(&data, &[starts.len() as i32, 1, n as i32, 2])
    }

    /// The positions query `query` of a `new`-row write reads: the key values under the
    /// mask's true entries.
    fn visible(f: &Fetched, query: usize, new: usize) -> Vec<i32> {
        visible_in(f, 0, query, new)
    }

    fn visible_in(f: &Fetched, row: i32, query: usize, new: usize) -> Vec<i32> {
        let slots = f.slots;
        let keys = f.keys.index((row, 0)).as_slice::<f32>()[..2 * slots].to_vec();
        let mask: Option<Vec<bool>> = match &f.mask {
            Mask::All => None,
            // The queries are the last `new` slots; each reads up to itself.
            Mask::Causal => Some((0..slots).map(|s| s + new <= slots + query).collect()),
            Mask::Array(m) => Some(m.index((row, 0, query as i32)).as_slice::<bool>().to_vec()),
        };
        in_position_order(&keys);
        let mut seen: Vec<i32> =
            (0..slots).filter(|&s| mask.as_ref().is_none_or(|m| m[s])).map(|s| keys[2 * s] as i32 - 1).collect();
        seen.sort();
        seen
    }

    /// Attention reads keys in position order, each in the lane of its position (slot j holds
    /// a position ≡ j mod PERIOD), whatever the ring's capacity: see [`super::in_position_order`].
    fn in_position_order(keys: &[f32]) {
        let held: Vec<(usize, i32)> =
            keys.chunks(2).map(|k| k[0] as i32 - 1).enumerate().filter(|&(_, p)| p >= 0).collect();
        for pair in held.windows(2) {
            assert!(pair[0].1 < pair[1].1, "positions out of order: {held:?}");
        }
        for &(slot, p) in &held {
            assert_eq!(slot % SUM_PERIOD, p as usize % SUM_PERIOD, "position {p} in slot {slot}: {held:?}");
        }
    }

    fn expected(q: usize, window: Option<usize>) -> Vec<i32> {
        let from = window.map_or(0, |w| (q + 1).saturating_sub(w));
        (from..=q).map(|p| p as i32).collect()
    }

    /// Writes far past the window with random accepted lengths and rollbacks, and checks
    /// every query reads exactly the positions a cache rebuilt from scratch would give it.
    fn run(mut cache: LayerCache, window: Option<usize>, slack: usize, seed: u64) {
        let mut state = seed;
        let mut next = |below: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % below as u64) as usize
        };
        let prompt = 1 + next(3 * window.unwrap_or(8));
        let f = cache.write(&rows(0, prompt), &rows(0, prompt)).unwrap();
        for q in 0..prompt {
            assert_eq!(visible(&f, q, prompt), expected(q, window), "prefill query {q}");
        }
        for _ in 0..200 {
            let start = cache.offsets()[0];
            let written = 1 + next(slack + 1);
            let f = cache.write(&rows(start, written), &rows(start, written)).unwrap();
            for j in 0..written {
                assert_eq!(
                    visible(&f, j, written),
                    expected(start + j, window),
                    "query {} of a {written}-row write",
                    start + j
                );
            }
            let keep = 1 + next(written);
            cache.rollback(&[written - keep]).unwrap();
            assert_eq!(cache.offsets()[0], start + keep);
        }
        // After all of that, a single decode step reads exactly its window.
        let start = cache.offsets()[0];
        let f = cache.write(&rows(start, 1), &rows(start, 1)).unwrap();
        assert_eq!(visible(&f, 0, 1), expected(start, window));
    }

    /// Rows that accept different lengths drift apart; each must still read its own window.
    fn run_rows(mut cache: LayerCache, rows: usize, window: Option<usize>, slack: usize) {
        let mut state = 99u64;
        let mut next = |below: usize| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % below as u64) as usize
        };
        let f = cache.write(&batch(&vec![0; rows], 5), &batch(&vec![0; rows], 5)).unwrap();
        for r in 0..rows {
            assert_eq!(visible_in(&f, r as i32, 4, 5), expected(4, window));
        }
        for _ in 0..150 {
            let starts = cache.offsets().to_vec();
            let written = 1 + next(slack + 1);
            let f = cache.write(&batch(&starts, written), &batch(&starts, written)).unwrap();
            for (r, &start) in starts.iter().enumerate() {
                for j in 0..written {
                    assert_eq!(
                        visible_in(&f, r as i32, j, written),
                        expected(start + j, window),
                        "row {r}, query {}",
                        start + j
                    );
                }
            }
            let back: Vec<usize> = (0..rows).map(|_| next(written)).collect();
            cache.rollback(&back).unwrap();
        }
    }

    #[test]
    fn rows_at_different_positions_keep_their_own_windows() {
        run_rows(LayerCache::sliding(3, 6, 4), 3, Some(6), 4);
        run_rows(LayerCache::full(3), 3, None, 4);
    }

    #[test]
    fn filtering_and_stacking_rows_keeps_their_contents() {
        let mut a = LayerCache::sliding(1, 4, 2);
        a.write(&rows(0, 9), &rows(0, 9)).unwrap();
        let mut b = LayerCache::sliding(1, 4, 2);
        b.write(&rows(0, 3), &rows(0, 3)).unwrap();
        let mut both = LayerCache::stack(vec![a, b]).unwrap();
        assert_eq!(both.offsets(), &[9, 3]);
        let f = both.write(&batch(&[9, 3], 1), &batch(&[9, 3], 1)).unwrap();
        assert_eq!(visible_in(&f, 0, 0, 1), expected(9, Some(4)));
        assert_eq!(visible_in(&f, 1, 0, 1), expected(3, Some(4)));
        both.filter_rows(&[1]).unwrap();
        let f = both.write(&batch(&[4], 1), &batch(&[4], 1)).unwrap();
        assert_eq!(visible(&f, 0, 1), expected(4, Some(4)));
    }

    #[test]
    fn ring_rollback_is_exact_across_many_wraps() {
        for seed in 1..6 {
            run(LayerCache::sliding(1, 8, 5), Some(8), 5, seed);
        }
    }

    #[test]
    fn ring_with_small_slack_still_exact() {
        run(LayerCache::sliding(1, 4, 1), Some(4), 1, 42);
    }

    #[test]
    fn full_cache_rollback_is_exact() {
        run(LayerCache::full(1), None, 7, 3);
    }

    #[test]
    fn a_prefill_longer_than_the_ring_sees_its_window() {
        let mut cache = LayerCache::sliding(1, 4, 2);
        let f = cache.write(&rows(0, 20), &rows(0, 20)).unwrap();
        for q in 0..20 {
            assert_eq!(visible(&f, q, 20), expected(q, Some(4)));
        }
        let f = cache.write(&rows(20, 1), &rows(20, 1)).unwrap();
        assert_eq!(visible(&f, 0, 1), expected(20, Some(4)));
    }

    #[test]
    fn rolling_back_more_than_the_slack_is_refused_once_wrapped() {
        let mut cache = LayerCache::sliding(1, 4, 2);
        cache.write(&rows(0, 10), &rows(0, 10)).unwrap();
        assert!(cache.rollback(&[3]).is_err());
        assert!(cache.rollback(&[2]).is_ok());
    }
}

//! KV caches of one row: a growing cache for full-attention layers and a ring for sliding
//! layers. Both roll back the last rows written exactly, also across the ring's wrap: the
//! ring holds `window + slack` slots, so rows rolled back never overwrote a row that is still
//! inside the window afterwards, and every slot records which position it holds.

use mlx_rs::error::Exception;
use mlx_rs::Array;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum CacheError {
    #[error("cannot roll back {requested} rows: {limit}")]
    Rollback { requested: usize, limit: String },
}

/// Rows a full cache grows by at a time.
const GROWTH: usize = 256;

pub struct LayerCache {
    /// The attention window for sliding layers; `None` for full attention.
    window: Option<usize>,
    /// Extra ring slots beyond the window: the most rows that can be rolled back.
    slack: usize,
    keys: Option<Array>,
    values: Option<Array>,
    /// The position each slot holds, -1 when empty.
    slot_positions: Vec<i32>,
    /// The next position to write.
    offset: usize,
}

/// What attention over the cache needs after a write.
pub struct Fetched {
    pub keys: Array,
    pub values: Array,
    /// [1, 1, L, S] true where a query may attend a key; `None` when every query sees every key.
    pub mask: Option<Array>,
}

impl LayerCache {
    pub fn full() -> LayerCache {
        LayerCache { window: None, slack: 0, keys: None, values: None, slot_positions: Vec::new(), offset: 0 }
    }

    /// A ring for a sliding window that can roll back up to `slack` rows.
    pub fn sliding(window: usize, slack: usize) -> LayerCache {
        LayerCache { window: Some(window), slack, keys: None, values: None, slot_positions: Vec::new(), offset: 0 }
    }

    pub fn offset(&self) -> usize {
        self.offset
    }

    pub fn window(&self) -> Option<usize> {
        self.window
    }

    /// The keys, values and per-slot positions as stored (for read-only views).
    pub fn storage(&self) -> Option<(&Array, &Array, &[i32])> {
        Some((self.keys.as_ref()?, self.values.as_ref()?, &self.slot_positions))
    }

    /// Writes keys/values [1, H, L, D] for the next L positions and returns what attention
    /// of those L queries reads.
    pub fn write(&mut self, keys: &Array, values: &Array) -> Result<Fetched, Exception> {
        let new = keys.shape()[2] as usize;
        let start = self.offset;
        match self.window {
            None => self.write_full(keys, values, start, new),
            Some(window) => self.write_ring(keys, values, start, new, window),
        }
    }

    /// Forgets the last `n` positions written.
    pub fn rollback(&mut self, n: usize) -> Result<(), CacheError> {
        if n > self.offset {
            return Err(CacheError::Rollback { requested: n, limit: format!("only {} rows are cached", self.offset) });
        }
        if self.window.is_some() && n > self.slack && self.offset > self.capacity_of_ring() {
            return Err(CacheError::Rollback { requested: n, limit: format!("the ring keeps {} rows beyond its window", self.slack) });
        }
        for position in self.offset - n..self.offset {
            let slot = self.slot_of(position);
            if self.slot_positions.get(slot) == Some(&(position as i32)) {
                self.slot_positions[slot] = -1;
            }
        }
        self.offset -= n;
        Ok(())
    }

    fn capacity_of_ring(&self) -> usize {
        self.window.map_or(usize::MAX, |w| w + self.slack)
    }

    fn slot_of(&self, position: usize) -> usize {
        match self.window {
            None => position,
            Some(_) => position % self.capacity_of_ring(),
        }
    }

    fn write_full(&mut self, keys: &Array, values: &Array, start: usize, new: usize) -> Result<Fetched, Exception> {
        let end = start + new;
        self.ensure_capacity(keys, values, end.div_ceil(GROWTH) * GROWTH)?;
        let (k, v) = (self.keys.take().unwrap(), self.values.take().unwrap());
        let (k, v) = (write_rows(&k, keys, start)?, write_rows(&v, values, start)?);
        for p in start..end {
            self.slot_positions[p] = p as i32;
        }
        let fetched_k = prefix(&k, end)?;
        let fetched_v = prefix(&v, end)?;
        self.keys = Some(k);
        self.values = Some(v);
        self.offset = end;
        // Keys are in position order: the usual causal mask over the last `new` rows.
        let mask = (new > 1).then(|| causal_mask(start, new, end, None)).transpose()?;
        Ok(Fetched { keys: fetched_k, values: fetched_v, mask })
    }

    fn write_ring(&mut self, keys: &Array, values: &Array, start: usize, new: usize, window: usize) -> Result<Fetched, Exception> {
        let capacity = window + self.slack;
        let end = start + new;
        self.ensure_capacity(keys, values, capacity)?;
        // Queries of this write read the window before their own position. When the write is
        // longer than the ring can hold alongside that window, attend over the ring as it was
        // followed by all new rows, then keep the newest rows in the ring.
        if new > self.slack + 1 {
            let old_positions = self.slot_positions.clone();
            let (ring_k, ring_v) = (self.keys.clone().unwrap(), self.values.clone().unwrap());
            let all_k = mlx_rs::ops::concatenate(&[&ring_k, keys], 2)?;
            let all_v = mlx_rs::ops::concatenate(&[&ring_v, values], 2)?;
            let mut positions = old_positions;
            positions.extend((start..end).map(|p| p as i32));
            let mask = position_mask(&positions, start, new, Some(window))?;
            self.store_ring(keys, values, start, new, capacity)?;
            return Ok(Fetched { keys: all_k, values: all_v, mask: Some(mask) });
        }
        self.store_ring(keys, values, start, new, capacity)?;
        let mask = position_mask(&self.slot_positions, start, new, Some(window))?;
        Ok(Fetched { keys: self.keys.clone().unwrap(), values: self.values.clone().unwrap(), mask: Some(mask) })
    }

    /// Writes the newest min(new, capacity) rows into their ring slots.
    fn store_ring(&mut self, keys: &Array, values: &Array, start: usize, new: usize, capacity: usize) -> Result<(), Exception> {
        let kept = new.min(capacity);
        let first = start + new - kept;
        let slots: Vec<i32> = (first..start + new).map(|p| (p % capacity) as i32).collect();
        let index = Array::from_slice(&slots, &[1, 1, kept as i32, 1]);
        let (keys, values) = if kept < new { (tail(keys, kept)?, tail(values, kept)?) } else { (keys.clone(), values.clone()) };
        let k = self.keys.take().unwrap().put_along_axis(&index, &keys, 2)?;
        let v = self.values.take().unwrap().put_along_axis(&index, &values, 2)?;
        self.keys = Some(k);
        self.values = Some(v);
        for p in first..start + new {
            self.slot_positions[p % capacity] = p as i32;
        }
        self.offset = start + new;
        Ok(())
    }

    /// Makes room for `slots` rows, keeping what is stored.
    fn ensure_capacity(&mut self, keys: &Array, values: &Array, slots: usize) -> Result<(), Exception> {
        let have = self.slot_positions.len();
        if have >= slots {
            return Ok(());
        }
        let grow = |stored: Option<&Array>, like: &Array| -> Result<Array, Exception> {
            let s = like.shape();
            let extra = Array::zeros::<f32>(&[s[0], s[1], (slots - have) as i32, s[3]])?.as_dtype(like.dtype())?;
            match stored {
                None => Ok(extra),
                Some(old) => mlx_rs::ops::concatenate(&[old, &extra], 2),
            }
        };
        self.keys = Some(grow(self.keys.as_ref(), keys)?);
        self.values = Some(grow(self.values.as_ref(), values)?);
        self.slot_positions.resize(slots, -1);
        Ok(())
    }
}

fn write_rows(stored: &Array, rows: &Array, start: usize) -> Result<Array, Exception> {
    let new = rows.shape()[2] as usize;
    let index: Vec<i32> = (start..start + new).map(|p| p as i32).collect();
    stored.put_along_axis(Array::from_slice(&index, &[1, 1, new as i32, 1]), rows, 2)
}

fn prefix(a: &Array, len: usize) -> Result<Array, Exception> {
    let index = Array::from_iter(0..len as i32, &[len as i32]);
    a.take_axis(&index, 2)
}

fn tail(a: &Array, len: usize) -> Result<Array, Exception> {
    let total = a.shape()[2] as usize;
    let index = Array::from_iter((total - len) as i32..total as i32, &[len as i32]);
    a.take_axis(&index, 2)
}

/// [1, 1, new, keys] causal mask for queries at start..start+new over keys at 0..keys.
fn causal_mask(start: usize, new: usize, keys: usize, window: Option<usize>) -> Result<Array, Exception> {
    let positions: Vec<i32> = (0..keys as i32).collect();
    position_mask(&positions, start, new, window)
}

/// [1, 1, new, slots]: query at position q sees a slot holding position p when 0 <= p <= q
/// and, in a window w, q - p < w.
fn position_mask(slot_positions: &[i32], start: usize, new: usize, window: Option<usize>) -> Result<Array, Exception> {
    let mut mask = Vec::with_capacity(new * slot_positions.len());
    for q in start..start + new {
        let q = q as i64;
        for &p in slot_positions {
            let p = p as i64;
            mask.push(p >= 0 && p <= q && window.is_none_or(|w| q - p < w as i64));
        }
    }
    Ok(Array::from_slice(&mask, &[1, 1, new as i32, slot_positions.len() as i32]))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops::indexing::IndexOp;

    /// Keys whose every element is its position, so attention inputs can be read back.
    fn rows(start: usize, n: usize) -> Array {
        let data: Vec<f32> = (start..start + n).flat_map(|p| [p as f32, p as f32]).collect();
        Array::from_slice(&data, &[1, 1, n as i32, 2])
    }

    /// The positions a query at `q` reads: the key values under the mask's true entries.
    fn visible(f: &Fetched, query: usize) -> Vec<i32> {
        let keys = f.keys.index((0, 0)).as_slice::<f32>().to_vec();
        let slots = keys.len() / 2;
        let mask = f.mask.as_ref().map(|m| m.index((0, 0, query as i32)).as_slice::<bool>().to_vec());
        let mut seen: Vec<i32> =
            (0..slots).filter(|&s| mask.as_ref().is_none_or(|m| m[s])).map(|s| keys[2 * s] as i32).collect();
        seen.sort();
        seen
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
            assert_eq!(visible(&f, q), expected(q, window), "prefill query {q}");
        }
        for _ in 0..200 {
            let start = cache.offset();
            let written = 1 + next(slack + 1);
            let f = cache.write(&rows(start, written), &rows(start, written)).unwrap();
            for j in 0..written {
                assert_eq!(visible(&f, j), expected(start + j, window), "query {} of a {written}-row write", start + j);
            }
            let keep = 1 + next(written);
            cache.rollback(written - keep).unwrap();
            assert_eq!(cache.offset(), start + keep);
        }
        // After all of that, a single decode step reads exactly its window.
        let start = cache.offset();
        let f = cache.write(&rows(start, 1), &rows(start, 1)).unwrap();
        assert_eq!(visible(&f, 0), expected(start, window));
    }

    #[test]
    fn ring_rollback_is_exact_across_many_wraps() {
        for seed in 1..6 {
            run(LayerCache::sliding(8, 5), Some(8), 5, seed);
        }
    }

    #[test]
    fn ring_with_small_slack_still_exact() {
        run(LayerCache::sliding(4, 1), Some(4), 1, 42);
    }

    #[test]
    fn full_cache_rollback_is_exact() {
        run(LayerCache::full(), None, 7, 3);
    }

    #[test]
    fn a_prefill_longer_than_the_ring_sees_its_window() {
        let mut cache = LayerCache::sliding(4, 2);
        let f = cache.write(&rows(0, 20), &rows(0, 20)).unwrap();
        for q in 0..20 {
            assert_eq!(visible(&f, q), expected(q, Some(4)));
        }
        let f = cache.write(&rows(20, 1), &rows(20, 1)).unwrap();
        assert_eq!(visible(&f, 0), expected(20, Some(4)));
    }

    #[test]
    fn rolling_back_more_than_the_slack_is_refused_once_wrapped() {
        let mut cache = LayerCache::sliding(4, 2);
        cache.write(&rows(0, 10), &rows(0, 10)).unwrap();
        assert!(cache.rollback(3).is_err());
        assert!(cache.rollback(2).is_ok());
    }
}

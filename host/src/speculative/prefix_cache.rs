//! Prompts already prefilled, kept so that a prompt extending one of them prefills only its new
//! tokens: the row's target caches and its drafter row (captured), keyed by the prompt tokens
//! before the last. One cache belongs to one [`super::LiveBatch`], so to one target and one
//! drafter. The least recently used entries go first once the target caches' bytes pass the
//! bound (the drafter's row states are opaque and not counted).

use plugin_api::abi::RowState;

use crate::model::LayerCache;

/// A prefilled prompt: what a row that starts with these tokens can start from.
pub(super) struct Prefix {
    pub caches: Vec<LayerCache>,
    pub drafter: Option<RowState>,
    /// Tokens already in `caches` (and in the drafter's row).
    pub len: usize,
}

struct Entry {
    tokens: Vec<u32>,
    caches: Vec<LayerCache>,
    drafter: Option<RowState>,
    bytes: usize,
    last_used: u64,
}

pub struct PrefixCache {
    capacity: usize,
    entries: Vec<Entry>,
    clock: u64,
}

impl PrefixCache {
    pub fn new(capacity_bytes: usize) -> PrefixCache {
        PrefixCache { capacity: capacity_bytes, entries: Vec::new(), clock: 0 }
    }

    /// Bytes of target caches held.
    pub fn bytes(&self) -> usize {
        self.entries.iter().map(|e| e.bytes).sum()
    }

    /// The longest entry whose tokens begin `prompt`, taken out of the cache (the row it
    /// starts goes on from its drafter state, which can be restored once).
    pub(super) fn take_longest(&mut self, prompt: &[u32]) -> Option<Prefix> {
        let best = (0..self.entries.len())
            .filter(|&i| prompt.starts_with(&self.entries[i].tokens) && !self.entries[i].tokens.is_empty())
            .max_by_key(|&i| self.entries[i].tokens.len())?;
        let entry = self.entries.swap_remove(best);
        Some(Prefix { caches: entry.caches, drafter: entry.drafter, len: entry.tokens.len() })
    }

    /// Keeps `caches` (one row) and `drafter` as the prefill of `tokens`, evicting the least
    /// recently used entries to stay within the bound. An entry larger than the bound is not kept.
    pub(super) fn insert(&mut self, tokens: Vec<u32>, caches: Vec<LayerCache>, drafter: Option<RowState>) {
        let bytes: usize = caches.iter().map(LayerCache::nbytes).sum();
        self.entries.retain(|e| e.tokens != tokens);
        if tokens.is_empty() || bytes > self.capacity {
            return;
        }
        while self.bytes() + bytes > self.capacity {
            let oldest = (0..self.entries.len()).min_by_key(|&i| self.entries[i].last_used).expect("over the bound");
            self.entries.swap_remove(oldest);
        }
        self.clock += 1;
        self.entries.push(Entry { tokens, caches, drafter, bytes, last_used: self.clock });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::Array;

    /// One full-attention cache holding `n` positions of 1 head of dimension 4, float32 (its
    /// bytes grow in steps of 256 positions).
    fn caches(n: usize) -> Vec<LayerCache> {
        let mut cache = LayerCache::full(1);
        let kv = Array::zeros::<f32>(&[1, 1, n as i32, 4]).unwrap();
        cache.write(&kv, &kv).unwrap();
        vec![cache]
    }

    #[test]
    fn the_longest_entry_that_begins_the_prompt_is_taken() {
        let mut c = PrefixCache::new(1 << 20);
        c.insert(vec![1, 2], caches(2), None);
        c.insert(vec![1, 2, 3], caches(3), None);
        c.insert(vec![1, 9, 9, 9], caches(4), None);
        assert_eq!(c.take_longest(&[1, 2, 3, 4]).map(|p| p.len), Some(3));
        assert_eq!(c.take_longest(&[1, 2, 3, 4]).map(|p| p.len), Some(2), "taken entries are gone");
        assert!(c.take_longest(&[5, 1, 2]).is_none());
        assert!(c.take_longest(&[1]).is_none());
    }

    #[test]
    fn the_least_recently_used_entries_go_past_the_bound() {
        let one = caches(8).iter().map(LayerCache::nbytes).sum::<usize>();
        let mut c = PrefixCache::new(2 * one);
        c.insert(vec![1], caches(8), None);
        c.insert(vec![2], caches(8), None);
        c.insert(vec![3], caches(8), None);
        assert_eq!(c.bytes(), 2 * one);
        assert!(c.take_longest(&[1, 0]).is_none(), "the oldest went first");
        assert!(c.take_longest(&[3, 0]).is_some());
        c.insert(vec![4], caches(600), None);
        assert!(c.take_longest(&[4, 0]).is_none(), "larger than the bound: not kept");
    }
}

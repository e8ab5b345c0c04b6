//! A verify forward over trees of drafts. Each node is a row of one token: its own position for
//! RoPE (the row's next position plus its depth), reading what its cache row holds and the
//! nodes of its path, nothing else. Nothing is written to the caches; the accepted path's keys
//! and values are written afterwards, as a chain's would be.
//!
//! A cache row's nodes share one array of keys: the row's cached keys in position order
//! ([`LayerCache::prefix`]), then its nodes in the tree's order, where every parent comes
//! before its children. So the keys a node reads come in position order, the others masked;
//! attention takes its terms in key order and a masked key adds nothing, so each node's
//! attention is, bit for bit, that of its token decoded alone.

use mlx_rs::error::Exception;
use mlx_rs::Array;
use plugin_api::nn::layout::{self, SlotRun};
use plugin_api::nn::ops::{attention_rows, KeyPiece, Mask, RowKeys};

use super::cache::LayerCache;

/// Where the nodes of a tree forward sit: per node row, in row order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TreeLayout {
    /// Node rows per cache row: row r's are r · width .. (r + 1) · width.
    pub width: usize,
    /// The cache row the node continues.
    pub cache_row: Vec<usize>,
    /// The node's position.
    pub positions: Vec<i32>,
    /// The node rows of its path: its cache row's first node (the pending token) down to itself.
    pub paths: Vec<Vec<usize>>,
}

impl TreeLayout {
    pub fn len(&self) -> usize {
        self.positions.len()
    }

    pub fn is_empty(&self) -> bool {
        self.positions.is_empty()
    }
}

/// One layer's keys and values in a tree forward, shared with the layers that reuse them.
pub(super) struct TreeKv {
    /// [N, Hkv, 1, D]: each node row's own.
    pub keys: Array,
    pub values: Array,
    /// Per cache row, [1, Hkv, cached + width, D]: its cached keys, then its node rows'.
    rows: Vec<(Array, Array)>,
    /// Per cache row, the keys each of its node rows reads among the row's.
    masks: Vec<Mask>,
}

impl TreeKv {
    /// The nodes' keys and values [N, Hkv, 1, D] with what `cache` holds.
    pub fn new(
        layout: &TreeLayout,
        keys: &Array,
        values: &Array,
        cache: Option<&LayerCache>,
    ) -> Result<Self, Exception> {
        let prefix = cache.and_then(LayerCache::prefix);
        let width = layout.width;
        let cache_rows = layout.len() / width;
        // Row r's keys: its cached ones in position order, then its node rows', gathered on the
        // host in one copy (an MLX op costs a round trip to its thread).
        let node = [0];
        let gather = |cached: Option<&Array>, nodes: &Array, r: usize| -> Result<Array, Exception> {
            let mut runs = Vec::with_capacity(width + 1);
            if let (Some(p), Some(array)) = (&prefix, cached) {
                runs.push(SlotRun { array, row: r, slots: &p.rows[r].slots });
            }
            runs.extend((r * width..(r + 1) * width).map(|row| SlotRun { array: nodes, row, slots: &node }));
            layout::gather_slots(&runs)
        };
        let mut rows = Vec::with_capacity(cache_rows);
        for r in 0..cache_rows {
            let (cached_keys, cached_values) = match &prefix {
                Some(p) => (Some(&p.keys), Some(&p.values)),
                None => (None, None),
            };
            rows.push((gather(cached_keys, keys, r)?, gather(cached_values, values, r)?));
        }
        // Per cache row, which of its keys each of its node rows reads [1, 1, width, keys].
        let mut masks = Vec::with_capacity(cache_rows);
        for r in 0..cache_rows {
            let cached = prefix.as_ref().map_or(0, |p| p.rows[r].positions.len());
            let keys = cached + width;
            let mut reads = vec![false; width * keys];
            for (i, j) in (r * width..(r + 1) * width).enumerate() {
                let row = &mut reads[i * keys..(i + 1) * keys];
                if let Some(p) = &prefix {
                    row[..cached]
                        .iter_mut()
                        .zip(p.rows[r].visible(layout.positions[j], p.window))
                        .for_each(|(m, v)| *m = v);
                }
                for &node in &layout.paths[j] {
                    row[cached + node - r * width] = true;
                }
            }
            masks.push(Mask::Array(Array::from_slice(&reads, &[1, 1, width as i32, keys as i32])));
        }
        Ok(TreeKv { keys: keys.clone(), values: values.clone(), rows, masks })
    }

    /// Attention of the node rows' queries q [N, Hq, 1, D]: each cache row's node rows as the
    /// queries of one attention row, as a chain's window is.
    pub fn attend(&self, q: &Array, layout: &TreeLayout, scale: f32) -> Result<Array, Exception> {
        let s = q.shape().to_vec();
        let (width, cache_rows) = (layout.width as i32, (layout.len() / layout.width) as i32);
        let q = layout::swap_axes_1_2(&layout::reshape(q, &[cache_rows, width, s[1], s[3]])?)?;
        let rows: Vec<RowKeys> = self
            .rows
            .iter()
            .zip(&self.masks)
            .map(|((keys, values), mask)| RowKeys {
                pieces: vec![KeyPiece { keys, values, row: 0 }],
                mask: mask.clone(),
            })
            .collect();
        let out = attention_rows(&q, &rows, scale)?;
        layout::reshape(&layout::swap_axes_1_2(&out)?, &s)
    }
}

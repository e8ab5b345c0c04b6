//! A verify forward over trees of drafts. Each node is a row of one token: its own position for
//! RoPE (the row's next position plus its depth), reading what its cache row holds and the
//! nodes of its path, nothing else. Nothing is written to the caches; the accepted path's keys
//! and values are written afterwards, as a chain's would be.
//!
//! A cache row's nodes share one array of keys: the row's cached keys in position order
//! ([`LayerCache::prefix`]), then its nodes in the tree's order, where every parent comes before its
//! children. So the keys a node reads come in position order, the others masked; attention
//! takes its terms in key order and a masked key adds nothing, so each node's attention is, bit
//! for bit, that of its token decoded alone.

use mlx_rs::error::Exception;
use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::Array;
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
    /// Per node row, the keys it reads among its cache row's.
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
        let prefix = cache.map(LayerCache::prefix).transpose()?.flatten();
        let width = layout.width;
        let cache_rows = layout.len() / width;
        // Each cache row's node rows [1, Hkv, width, D], after its cached keys.
        let by_row = |a: &Array| -> Result<Array, Exception> {
            let s = a.shape();
            a.reshape(&[cache_rows as i32, width as i32, s[1], s[3]])?.transpose_axes(&[0, 2, 1, 3])
        };
        let (node_keys, node_values) = (by_row(keys)?, by_row(values)?);
        let mut rows = Vec::with_capacity(cache_rows);
        for r in 0..cache_rows {
            let own = |a: &Array| a.try_index((r as i32..r as i32 + 1, .., .., ..));
            let cached = prefix.as_ref().and_then(|p| p.rows[r].keys.as_ref().zip(p.rows[r].values.as_ref()));
            let (k, v) = match cached {
                Some((k, v)) => (concatenate(&[k, &own(&node_keys)?], 2)?, concatenate(&[v, &own(&node_values)?], 2)?),
                None => (own(&node_keys)?, own(&node_values)?),
            };
            rows.push((kernels::row_major(&k)?, kernels::row_major(&v)?));
        }
        let mut masks = Vec::with_capacity(layout.len());
        for (j, path) in layout.paths.iter().enumerate() {
            let r = layout.cache_row[j];
            let mut reads: Vec<bool> = match &prefix {
                Some(p) => p.rows[r].visible(layout.positions[j], p.window).collect(),
                None => Vec::new(),
            };
            let first = reads.len();
            reads.resize(first + width, false);
            for &node in path {
                reads[first + node - r * width] = true;
            }
            masks.push(Mask::Array(Array::from_slice(&reads, &[1, 1, 1, reads.len() as i32])));
        }
        Ok(TreeKv { keys: keys.clone(), values: values.clone(), rows, masks })
    }

    /// Attention of the node rows' queries q [N, Hq, 1, D].
    pub fn attend(&self, q: &Array, layout: &TreeLayout, scale: f32) -> Result<Array, Exception> {
        let rows: Vec<RowKeys> = (0..layout.len())
            .map(|j| {
                let (keys, values) = &self.rows[layout.cache_row[j]];
                RowKeys { pieces: vec![KeyPiece { keys, values, row: 0 }], mask: self.masks[j].clone() }
            })
            .collect();
        attention_rows(q, &rows, scale)
    }
}

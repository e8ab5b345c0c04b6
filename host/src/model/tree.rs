//! A verify forward over trees of drafts. Each node is a row of one token: its own position for
//! RoPE (the row's next position plus its depth), reading what its cache row holds and the
//! nodes of its path, nothing else. Nothing is written to the caches; the accepted path's keys
//! and values are written afterwards, as a chain's would be.
//!
//! A node's keys lie as plain decoding lays them: the cache row's keys in position order from a
//! multiple of the products' period ([`Prefix`]), then the path's in position order, so that
//! every key falls in the lane of its position and the node's attention is, bit for bit, the
//! attention of the token at that position decoded alone (`cache.rs`, `in_position_order`).

use mlx_rs::error::Exception;
use mlx_rs::Array;
use plugin_api::nn::ops::{attention_rows, KeyPiece, Mask, RowKeys};

use super::cache::{LayerCache, Prefix};

/// Where the nodes of a tree forward sit: per node row, in row order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TreeLayout {
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

    /// The longest path.
    fn longest(&self) -> usize {
        self.paths.iter().map(Vec::len).max().unwrap_or(0)
    }
}

/// One layer's keys and values in a tree forward, shared with the layers that reuse them.
pub(super) struct TreeKv {
    /// [N, Hkv, 1, D]: each node row's own.
    pub keys: Array,
    pub values: Array,
    prefix: Option<Prefix>,
    /// [N, Hkv, longest path, D]: each node row's path's, in position order.
    path_keys: Array,
    path_values: Array,
    /// Per node row, the keys it reads: its cache row's, then its path's.
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
        let longest = layout.longest();
        // Paths padded with their own last node, which the mask hides.
        let index: Vec<i32> = layout
            .paths
            .iter()
            .flat_map(|path| (0..longest).map(move |i| *path.get(i).unwrap_or(path.last().expect("a path")) as i32))
            .collect();
        let index = Array::from_slice(&index, &[index.len() as i32]);
        let along_paths = |a: &Array| -> Result<Array, Exception> {
            let s = a.shape();
            let gathered = a.take_axis(&index, 0)?.reshape(&[s[0], longest as i32, s[1], s[3]])?;
            kernels::row_major(&gathered.transpose_axes(&[0, 2, 1, 3])?)
        };
        let (path_keys, path_values) = (along_paths(keys)?, along_paths(values)?);
        let mut masks = Vec::with_capacity(layout.len());
        for (j, path) in layout.paths.iter().enumerate() {
            let mut reads: Vec<bool> = match &prefix {
                Some(p) => p.rows[layout.cache_row[j]].visible(layout.positions[j], p.window).collect(),
                None => Vec::new(),
            };
            reads.extend((0..longest).map(|i| i < path.len()));
            masks.push(Mask::Array(Array::from_slice(&reads, &[1, 1, 1, reads.len() as i32])));
        }
        Ok(TreeKv { keys: keys.clone(), values: values.clone(), prefix, path_keys, path_values, masks })
    }

    /// Attention of the node rows' queries q [N, Hq, 1, D].
    pub fn attend(&self, q: &Array, layout: &TreeLayout, scale: f32) -> Result<Array, Exception> {
        let rows: Vec<RowKeys> = (0..layout.len())
            .map(|j| {
                let mut pieces = Vec::with_capacity(2);
                if let Some(row) = self.prefix.as_ref().map(|p| &p.rows[layout.cache_row[j]]) {
                    if let (Some(keys), Some(values)) = (&row.keys, &row.values) {
                        pieces.push(KeyPiece { keys, values, row: 0 });
                    }
                }
                pieces.push(KeyPiece { keys: &self.path_keys, values: &self.path_values, row: j });
                RowKeys { pieces, mask: self.masks[j].clone() }
            })
            .collect();
        attention_rows(q, &rows, scale)
    }
}

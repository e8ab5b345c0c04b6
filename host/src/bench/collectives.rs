//! `host launch -n N -- bench --collectives`: the latency and throughput of the collectives a
//! tensor-parallel target runs per token, at the sizes it runs them (a hidden state to sum
//! after o_proj and down_proj, a slice of the vocabulary to gather after the head).

use std::time::Instant;

use mlx_rs::{Array, Dtype};
use serde::Serialize;

use crate::distributed::{self, Group};

const WARMUP: usize = 20;
const REPEATS: usize = 300;

#[derive(Debug, Serialize)]
pub struct CollectiveRow {
    pub op: &'static str,
    pub what: &'static str,
    /// Elements each rank contributes.
    pub elements: usize,
    pub dtype: String,
    /// Median and 90th percentile of one collective, evaluated on its own.
    pub median_us: f64,
    pub p90_us: f64,
}

#[derive(Debug, Serialize)]
pub struct CollectiveReport {
    pub ranks: usize,
    pub rows: Vec<CollectiveRow>,
}

#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error(
        "--collectives times MLX's collectives between ranks: run it as `host launch -n 2 -- bench --collectives`"
    )]
    NotARank,
    #[error(transparent)]
    Distributed(#[from] distributed::DistributedError),
    #[error("MLX: {0}")]
    Mlx(#[from] mlx_rs::error::Exception),
}

impl CollectiveReport {
    pub fn text(&self) -> String {
        let mut out = format!(
            "collectives over {} ranks (MLX ring backend), one at a time\n{:<10} {:<34} {:>9} {:>9} {:>10} {:>10}\n",
            self.ranks, "op", "what", "elements", "dtype", "median µs", "p90 µs"
        );
        for r in &self.rows {
            out += &format!(
                "{:<10} {:<34} {:>9} {:>9} {:>10.1} {:>10.1}\n",
                r.op, r.what, r.elements, r.dtype, r.median_us, r.p90_us
            );
        }
        out
    }
}

pub fn collectives() -> Result<CollectiveReport, CollectiveError> {
    let group = distributed::group()?.ok_or(CollectiveError::NotARank)?;
    let vocab_slice = 262_144 / group.size;
    let cases: [(&'static str, &'static str, usize, Dtype); 5] = [
        ("all_sum", "hidden state, bench model", 512, Dtype::Float32),
        ("all_sum", "hidden state, Gemma 4 31B", 5376, Dtype::Bfloat16),
        ("all_sum", "5 hidden states, Gemma 4 31B", 5 * 5376, Dtype::Bfloat16),
        ("all_gather", "logits slice, 262,144 vocabulary", vocab_slice, Dtype::Float32),
        ("all_gather", "5 logits slices", 5 * vocab_slice, Dtype::Float32),
    ];
    let mut rows = Vec::new();
    for (op, what, elements, dtype) in cases {
        let x = Array::ones::<f32>(&[elements as i32])?.as_dtype(dtype)?;
        x.eval()?;
        let mut times = Vec::with_capacity(REPEATS);
        for i in 0..WARMUP + REPEATS {
            let start = Instant::now();
            run(group, op, &x)?.eval()?;
            if i >= WARMUP {
                times.push(start.elapsed().as_secs_f64() * 1e6);
            }
        }
        times.sort_by(f64::total_cmp);
        rows.push(CollectiveRow {
            op,
            what,
            elements,
            dtype: format!("{dtype:?}").to_lowercase(),
            median_us: times[times.len() / 2],
            p90_us: times[times.len() * 9 / 10],
        });
    }
    Ok(CollectiveReport { ranks: group.size, rows })
}

fn run(group: &Group, op: &str, x: &Array) -> Result<Array, mlx_rs::error::Exception> {
    match op {
        "all_sum" => group.all_sum(x),
        _ => group.all_gather(x),
    }
}

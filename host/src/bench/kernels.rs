//! `host bench --kernels`: products of a few rows with one 4096×4096 weight per format, the
//! host's loops (`kernels`) against MLX's own op, as weight bytes read per second, next to
//! this machine's read bandwidth measured in the same run.

use std::time::Instant;

use mlx_rs::error::Exception;
use mlx_rs::{random, Array, Dtype};
use plugin_api::nn::{Linear, Quantization};
use serde::Serialize;

use super::SamplingRow;

const SIDE: i32 = 4096;
const ROWS: [i32; 5] = [1, 2, 4, 8, 16];
const REPEATS: usize = 7;

#[derive(Debug, Serialize)]
pub struct KernelRow {
    pub format: String,
    pub rows: i32,
    /// Weight bytes per second, host loops and MLX's op.
    pub host_gb_per_s: f64,
    pub mlx_gb_per_s: f64,
}

#[derive(Debug, Serialize)]
pub struct KernelReport {
    pub memory_gb_per_s: f64,
    pub rows: Vec<KernelRow>,
    /// One sampled token from logits over Gemma 4's real vocabulary.
    pub sampling: Vec<SamplingRow>,
}

impl KernelReport {
    pub fn text(&self) -> String {
        let mut out = format!(
            "products of a {SIDE}×{SIDE} weight, GB/s of weights read (machine: {:.1} GB/s)\n{:<18} {:>4} {:>8} {:>8} {:>7}\n",
            self.memory_gb_per_s, "format", "rows", "host", "mlx", "ratio"
        );
        for r in &self.rows {
            out += &format!(
                "{:<18} {:>4} {:>8.1} {:>8.1} {:>6.1}×\n",
                r.format,
                r.rows,
                r.host_gb_per_s,
                r.mlx_gb_per_s,
                r.host_gb_per_s / r.mlx_gb_per_s
            );
        }
        out += &format!("sampling one token from {VOCAB} logits (normal, σ = 3)\n");
        for r in &self.sampling {
            out += &format!("{:<40} {:>6.2} ms\n", r.settings, r.milliseconds);
        }
        out
    }
}

/// Gemma 4's vocabulary.
const VOCAB: i32 = 262_144;

/// A weight format: its layer, the activation dtype models of that format run in, and the
/// weight as MLX holds it (with its scales, biases and quantization where quantized), for MLX's
/// own product.
struct Format {
    name: String,
    linear: Linear,
    mlx_weight: Array,
    mlx_quantized: Option<(Array, Array, Quantization)>,
    activations: Dtype,
}

fn formats() -> Result<Vec<Format>, Exception> {
    let w = random::normal::<f32>(&[SIDE, SIDE], None, 0.02, &random::key(0)?)?;
    let plain = |w: Array, activations| {
        let linear = Linear::plain(w.clone());
        let name = match (activations, linear.is_tiled()) {
            (Dtype::Float32, _) => "float32",
            (_, false) => "bfloat16",
            (_, true) => "bfloat16 AMX",
        };
        Format { name: name.into(), linear, mlx_weight: w, mlx_quantized: None, activations }
    };
    let mut out = vec![plain(w.clone(), Dtype::Float32), plain(w.as_dtype(Dtype::Bfloat16)?, Dtype::Bfloat16)];
    // Quantized as mlx-lm converts float32 checkpoints (float32 scales and activations) and
    // bfloat16 ones (bfloat16 scales and activations).
    for (activations, label) in [(Dtype::Float32, "f32"), (Dtype::Bfloat16, "bf16")] {
        for bits in [8, 4] {
            let group_size = 64;
            let (packed, scales, biases) = mlx_rs::ops::quantize(w.as_dtype(activations)?, group_size, bits)?;
            let q = Quantization { group_size, bits };
            let linear = Linear::quantized(packed.clone(), scales.clone(), biases.clone(), q);
            let tiled = if linear.is_tiled() { " AMX" } else { "" };
            out.push(Format {
                name: format!("{bits}-bit g{group_size} {label}{tiled}"),
                linear,
                mlx_weight: packed,
                mlx_quantized: Some((scales, biases, q)),
                activations,
            });
        }
    }
    Ok(out)
}

fn mlx_product(f: &Format, x: &Array) -> Result<Array, Exception> {
    match &f.mlx_quantized {
        Some((s, b, q)) => mlx_rs::ops::quantized_matmul(x, &f.mlx_weight, s, b, true, q.group_size, q.bits),
        None => x.matmul(f.mlx_weight.t()),
    }
}

/// Median seconds of `f`, evaluated each time.
fn time(mut f: impl FnMut() -> Result<Array, Exception>) -> Result<f64, Exception> {
    f()?.eval()?;
    let mut samples = Vec::with_capacity(REPEATS);
    for _ in 0..REPEATS {
        let start = Instant::now();
        f()?.eval()?;
        samples.push(start.elapsed().as_secs_f64());
    }
    Ok(super::summary(&samples).0)
}

pub fn kernels() -> Result<KernelReport, Exception> {
    let memory_gb_per_s = super::memory_bandwidth_gb_per_s();
    let mut rows = Vec::new();
    for f in formats()? {
        mlx_rs::transforms::eval(
            [&f.mlx_weight].into_iter().chain(f.mlx_quantized.iter().flat_map(|(s, b, _)| [s, b])),
        )?;
        let bytes = f.linear.nbytes() as f64;
        for m in ROWS {
            let x = random::normal::<f32>(&[1, m, SIDE], None, None, &random::key(1)?)?.as_dtype(f.activations)?;
            x.eval()?;
            let host = time(|| f.linear.forward(&x))?;
            let mlx = time(|| mlx_product(&f, &x))?;
            rows.push(KernelRow {
                format: f.name.clone(),
                rows: m,
                host_gb_per_s: bytes / host / 1e9,
                mlx_gb_per_s: bytes / mlx / 1e9,
            });
        }
    }
    let logits = random::normal::<f32>(&[VOCAB], None, 3.0, &random::key(2)?)?;
    logits.eval()?;
    let sampling = super::sampling_cost(&logits, REPEATS).map_err(|e| Exception::custom(e.to_string()))?;
    Ok(KernelReport { memory_gb_per_s, rows, sampling })
}

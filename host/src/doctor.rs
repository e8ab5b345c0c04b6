//! `host doctor`: what this process runs on, read from the process itself.

use std::path::PathBuf;
use std::time::Instant;

use kernels::route::Route;
use mlx_rs::{random, Array, Device};
use serde::Serialize;

use crate::runtime;

#[derive(Debug, Serialize)]
pub struct Report {
    pub mlx_version: String,
    /// Every MLX library loaded into the process; exactly one when host and plugins share it.
    pub libmlx_path: Vec<PathBuf>,
    pub blas: Option<String>,
    pub blas_path: Option<PathBuf>,
    pub device: String,
    pub plugins_dir: PathBuf,
    /// Median f32 throughput of a 512×512×512 matrix product.
    pub matmul_gflops: f64,
    /// Whether bfloat16 and quantized products take AMX's tile unit, could (`HOST_AMX=off`), or
    /// cannot here.
    pub amx_tiles: String,
    /// The route every op takes: `cpu` (the host's kernels where they apply) or `mlx` (MLX's
    /// own ops, as on Metal and CUDA), and why (`HOST_KERNELS`, the device).
    pub route: String,
    pub route_why: String,
    /// The widest loops the products take on this CPU: `amx`, `avx512`, `avx512-nobf16`, `avx2`
    /// or `portable` (`HOST_SIMD` narrows it).
    pub vector_loops: String,
}

impl Report {
    pub fn collect(plugins_dir: PathBuf) -> Result<Report, mlx_rs::error::Exception> {
        runtime::init();
        let matmul_gflops = matmul_gflops(512, 20)?;
        let blas = runtime::blas_in_use();
        Ok(Report {
            mlx_version: runtime::mlx_version(),
            libmlx_path: runtime::libmlx_paths().unwrap_or_default(),
            blas: blas.as_ref().map(|b| b.name.clone()),
            blas_path: blas.map(|b| b.path),
            device: Device::default().to_string(),
            plugins_dir,
            matmul_gflops,
            amx_tiles: amx_tiles().into(),
            route: match kernels::route::choice().route {
                Route::Cpu => "cpu".into(),
                Route::Mlx => "mlx".into(),
            },
            route_why: kernels::route::choice().why.clone(),
            vector_loops: vector_loops(),
        })
    }

    pub fn human(&self) -> String {
        let or_unknown = |v: Option<String>| v.unwrap_or_else(|| "not found".into());
        let paths: Vec<String> = self.libmlx_path.iter().map(|p| p.display().to_string()).collect();
        let lines = [
            ("MLX", self.mlx_version.clone()),
            ("libmlx", if paths.is_empty() { "not loaded".into() } else { paths.join(", ") }),
            ("BLAS", or_unknown(self.blas.clone())),
            ("", or_unknown(self.blas_path.as_ref().map(|p| p.display().to_string()))),
            ("device", self.device.clone()),
            ("route", format!("{} ({})", self.route, self.route_why)),
            ("plugins dir", self.plugins_dir.display().to_string()),
            ("matmul f32", format!("{:.1} GFLOP/s (512×512×512)", self.matmul_gflops)),
            ("AMX tiles", self.amx_tiles.clone()),
            ("loops", self.vector_loops.clone()),
        ];
        lines
            .iter()
            .map(|(label, value)| match label.is_empty() {
                true => format!("{:13}{value}\n", ""),
                false => format!("{:13}{value}\n", format!("{label}:")),
            })
            .collect()
    }
}

fn amx_tiles() -> &'static str {
    use kernels::amx_bf16;
    if !kernels::route::on_cpu() {
        return "not used: the route is MLX's ops";
    }
    match (amx_bf16::available(), amx_bf16::supported()) {
        (true, _) => "in use for bfloat16 and quantized products (HOST_AMX=off leaves them to the AVX-512 loops)",
        (false, true) => "on this CPU, not used (HOST_AMX=off)",
        (false, false) => "not on this CPU",
    }
}

fn vector_loops() -> String {
    let route = kernels::simd::product_route();
    match std::env::var(kernels::simd::SIMD_ENV) {
        Ok(v) if !v.trim().is_empty() && v.trim() != "auto" => format!("{route} ({}={v})", kernels::simd::SIMD_ENV),
        _ => format!("{route} (the widest this CPU has; {}=avx2 or portable narrows it)", kernels::simd::SIMD_ENV),
    }
}

/// Median GFLOP/s of `runs` evaluated n×n×n f32 matrix products, after two warm-up runs.
pub fn matmul_gflops(n: i32, runs: usize) -> Result<f64, mlx_rs::error::Exception> {
    let key = random::key(0)?;
    let a: Array = random::normal::<f32>(&[n, n], None, None, &key)?;
    let b: Array = random::normal::<f32>(&[n, n], None, None, &key)?;
    mlx_rs::transforms::eval([&a, &b])?;
    let mut seconds = Vec::with_capacity(runs);
    for i in 0..runs + 2 {
        let start = Instant::now();
        a.matmul(&b)?.eval()?;
        if i >= 2 {
            seconds.push(start.elapsed().as_secs_f64());
        }
    }
    seconds.sort_by(f64::total_cmp);
    let median = seconds[seconds.len() / 2];
    Ok(2.0 * f64::from(n).powi(3) / median / 1e9)
}

//! `host bench`: the host's plain decoding against mlx-lm's own generation (or llama.cpp's
//! `llama-bench` on a GGUF of it) on the same checkpoint, paired and interleaved (ABBA order, so drift hits both sides alike), with the
//! ratio per pair and its spread, and the memory-bandwidth bound for the checkpoint.

use std::path::PathBuf;
use std::time::Instant;

use crate::generate::{generate, GenerateError, Request};
use crate::model::Gemma4;
use crate::sampling::{sample, SampleError, SamplingParams};

pub mod collectives;
pub mod kernels;
pub mod plot;
pub mod ranks;
mod report;
mod serving;
pub mod sweep;
pub use report::{bench, BenchOptions, BenchReport, BenchRunError, MLX_LM_PYTHON_ENV};
pub use serving::{ServingBench, ServingRow};

/// The script that times mlx-lm's own generation, run with `python -c`.
const MLX_LM_DECODE: &str = include_str!("mlx_lm_decode.py");

#[derive(Debug, Clone)]
pub struct BenchConfig {
    pub pairs: usize,
    /// What the host is measured against; none to time the host alone.
    pub reference: Option<Reference>,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error(transparent)]
    Generate(#[from] GenerateError),
    #[error("running the reference ({command}): {reason}")]
    Reference { command: String, reason: String },
}

/// The other program plain decoding is measured against, on the same checkpoint.
#[derive(Debug, Clone)]
pub enum Reference {
    /// mlx-lm's own generation, run by this Python (which has mlx-lm installed).
    MlxLm(PathBuf),
    /// llama.cpp's `llama-bench` on a GGUF conversion of the checkpoint, at `threads` threads:
    /// prefill of the prompt's length and decoding of `max_tokens`, timed apart, as llama.cpp
    /// times them, with `args` added to its command line.
    LlamaCpp { llama_bench: PathBuf, gguf: PathBuf, threads: usize, args: Vec<String> },
}

impl Reference {
    pub fn name(&self) -> &'static str {
        match self {
            Reference::MlxLm(_) => "mlx-lm",
            Reference::LlamaCpp { .. } => "llama.cpp",
        }
    }

    /// Bytes one decode step reads, where known: a GGUF's file (weights and their scales, the
    /// tied head read once per token).
    fn bytes_per_token(&self) -> Option<usize> {
        match self {
            Reference::MlxLm(_) => None,
            Reference::LlamaCpp { gguf, .. } => std::fs::metadata(gguf).ok().map(|m| m.len() as usize),
        }
    }

    fn run(&self, model_dir: &std::path::Path, request: &Request) -> Result<Throughput, BenchError> {
        match self {
            Reference::MlxLm(python) => run_mlx_lm(python, model_dir, request),
            Reference::LlamaCpp { llama_bench, gguf, threads, args } => {
                run_llama_bench(llama_bench, gguf, *threads, args, request.prompt.len(), request.max_tokens)
            }
        }
    }
}

/// Throughput of one run.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Throughput {
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
}

#[derive(Debug, serde::Serialize)]
pub struct PlainBench {
    /// Which x86 loops the host's products took (`amx`, `avx512`, `avx2`, `portable`), or
    /// `mlx` where MLX's ops computed.
    pub host_route: String,
    pub host: Vec<Throughput>,
    /// `mlx-lm` or `llama.cpp`; none when the host ran alone.
    pub reference_name: Option<String>,
    pub reference: Vec<Throughput>,
    /// host / reference per pair.
    pub decode_ratios: Vec<f64>,
    pub prefill_ratios: Vec<f64>,
    pub weight_bytes_per_token: usize,
    /// The CPU's read bandwidth and the decode rate it bounds; none when MLX runs on another
    /// device, whose memory this does not measure.
    pub memory_gb_per_s: Option<f64>,
    pub bandwidth_bound_tokens_per_s: Option<f64>,
    /// The read bandwidth of two threads on two cores (the median of the readings taken before
    /// each pair), and the share of it each program's decoding reads (the reference's where its
    /// bytes per token are known): per run against its pair's reading, the median over pairs.
    pub memory_gb_per_s_two_threads: Option<f64>,
    pub host_share_of_two_threads: Option<f64>,
    pub reference_share_of_two_threads: Option<f64>,
    /// A verify window of [`WINDOW`] tokens over a one-token step, both after the prompt:
    /// medians of interleaved forwards (logits included), and their ratio.
    pub step_ms: f64,
    pub window_ms: f64,
    pub window_over_step: f64,
    /// One sampled token from the logits after the prompt, per setting.
    pub sampling: Vec<SamplingRow>,
}

/// What choosing one token costs at some sampling settings.
#[derive(Debug, serde::Serialize)]
pub struct SamplingRow {
    pub settings: String,
    pub milliseconds: f64,
}

/// Median milliseconds of [`sample`] on `logits` [V], `repetitions` draws (at different output
/// positions) per setting: the filters and the draw of a sampled step. Then the draw as MLX ops,
/// which serves off the CPU, for comparison.
pub fn sampling_cost(logits: &mlx_rs::Array, repetitions: usize) -> Result<Vec<SamplingRow>, SampleError> {
    let top_p = SamplingParams { temperature: 0.7, top_p: 0.95, ..Default::default() };
    let settings: [(&str, SamplingParams, Draw); 4] = [
        ("temperature 0.7, top-p 0.95", top_p, sample),
        ("temperature 1.0, no filter", SamplingParams { temperature: 1.0, ..Default::default() }, sample),
        ("temperature 0.7, top-k 40", SamplingParams { temperature: 0.7, top_k: 40, ..Default::default() }, sample),
        ("temperature 0.7, top-p 0.95, as MLX ops", top_p, crate::sampling::on_device::draw),
    ];
    let mut rows = Vec::new();
    for (settings, params, draw) in settings {
        let mut samples = Vec::with_capacity(repetitions);
        for step in 0..repetitions as u64 {
            let start = Instant::now();
            draw(logits, &params, step)?;
            samples.push(start.elapsed().as_secs_f64() * 1e3);
        }
        rows.push(SamplingRow { settings: settings.into(), milliseconds: summary(&samples).0 });
    }
    Ok(rows)
}

/// A way to draw a token: [`sample`] or the MLX ops of `sampling::on_device`.
type Draw = fn(&mlx_rs::Array, &SamplingParams, u64) -> Result<u32, SampleError>;

/// The verify window the bench times: a pending token and four drafts.
pub const WINDOW: usize = 5;

pub fn plain(
    model: &Gemma4,
    model_dir: &std::path::Path,
    request: &Request,
    config: &BenchConfig,
) -> Result<PlainBench, BenchError> {
    // One unmeasured run of each, so that neither side pays first-touch costs in the sample.
    let reference = |r: &Reference| r.run(model_dir, request);
    // llama-bench times decoding from an empty context, apart from its prefill: against it the
    // host's decoding is timed from a one-token prompt too, so that both read the same cache.
    let apart = matches!(config.reference, Some(Reference::LlamaCpp { .. }));
    let host_run = || run_host(model, request, apart);
    host_run()?;
    if let Some(r) = &config.reference {
        reference(r)?;
    }
    let on_cpu = ::kernels::route::on_cpu();
    let (mut host, mut other, mut two_threads) = (Vec::new(), Vec::new(), Vec::new());
    for pair in 0..config.pairs {
        // The bandwidth a machine shared with others gives varies from minute to minute: each
        // pair's decoding is held to a reading taken with it.
        if on_cpu {
            two_threads.push(crate::runtime::starting_children(|| memory_bandwidth_gb_per_s_threads(2)));
        }
        match &config.reference {
            None => host.push(host_run()?),
            Some(r) if pair % 2 == 0 => {
                host.push(host_run()?);
                other.push(reference(r)?);
            }
            Some(r) => {
                other.push(reference(r)?);
                host.push(host_run()?);
            }
        }
    }
    let (step_ms, window_ms, logits) = window_cost(model, &request.prompt, 4 * config.pairs.max(1))?;
    let sampling = sampling_cost(&logits, 20).map_err(|e| GenerateError::Internal(e.to_string()))?;
    let ratios = |f: fn(&Throughput) -> f64| host.iter().zip(&other).map(|(h, m)| f(h) / f(m)).collect::<Vec<_>>();
    let weight_bytes_per_token = model.weight_bytes_per_token();
    let memory_gb_per_s = on_cpu.then(memory_bandwidth_gb_per_s);
    // Each run's bytes a second over its pair's reading, the median over the pairs.
    let share = |bytes: usize, runs: &[Throughput]| {
        (!two_threads.is_empty() && runs.len() == two_threads.len()).then(|| {
            let shares: Vec<f64> = runs
                .iter()
                .zip(&two_threads)
                .map(|(t, bw)| bytes as f64 * t.decode_tokens_per_s / (bw * 1e9))
                .collect();
            summary(&shares).0
        })
    };
    let reference_bytes = config.reference.as_ref().and_then(Reference::bytes_per_token);
    Ok(PlainBench {
        host_route: match on_cpu {
            true => ::kernels::simd::product_route().into(),
            false => "mlx".into(),
        },
        decode_ratios: ratios(|t| t.decode_tokens_per_s),
        prefill_ratios: ratios(|t| t.prefill_tokens_per_s),
        host_share_of_two_threads: share(weight_bytes_per_token, &host),
        reference_share_of_two_threads: reference_bytes.and_then(|bytes| share(bytes, &other)),
        host,
        reference_name: config.reference.as_ref().map(|r| r.name().to_owned()),
        reference: other,
        weight_bytes_per_token,
        memory_gb_per_s,
        bandwidth_bound_tokens_per_s: memory_gb_per_s.map(|m| m * 1e9 / weight_bytes_per_token as f64),
        memory_gb_per_s_two_threads: (!two_threads.is_empty()).then(|| summary(&two_threads).0),
        step_ms,
        window_ms,
        window_over_step: window_ms / step_ms,
        sampling,
    })
}

/// Median milliseconds of a one-token forward and of a [`WINDOW`]-token one after `prompt`,
/// `repetitions` of each in alternation, the caches rolled back after each; and the logits [V]
/// of a one-token step.
fn window_cost(model: &Gemma4, prompt: &[u32], repetitions: usize) -> Result<(f64, f64, mlx_rs::Array), GenerateError> {
    let internal = |e: crate::model::cache::CacheError| GenerateError::Internal(e.to_string());
    let mut caches = model.make_caches(1, WINDOW);
    let forward =
        |tokens: &[u32], caches: &mut [crate::model::LayerCache]| -> Result<(f64, mlx_rs::Array), GenerateError> {
            let started = Instant::now();
            let hidden = model.forward_hidden(&crate::generate::token_ids(tokens), caches, None)?;
            let logits = model.logits_from_hidden(&hidden)?;
            logits.eval()?;
            Ok((started.elapsed().as_secs_f64() * 1e3, logits))
        };
    for chunk in prompt.chunks(crate::generate::PREFILL_CHUNK) {
        forward(chunk, &mut caches)?;
    }
    let last = prompt.last().copied().unwrap_or(0);
    let (mut step, mut window) = (Vec::new(), Vec::new());
    let mut step_logits = None;
    for _ in 0..=repetitions {
        for (times, width) in [(&mut step, 1), (&mut window, WINDOW)] {
            let (ms, logits) = forward(&vec![last; width], &mut caches)?;
            times.push(ms);
            if width == 1 {
                step_logits = Some(logits);
            }
            for cache in caches.iter_mut() {
                cache.rollback(&[width]).map_err(internal)?;
            }
        }
    }
    let step_logits = step_logits.expect("at least one step").reshape(&[-1])?;
    // The first of each warms up.
    Ok((summary(&step[1..]).0, summary(&window[1..]).0, step_logits))
}

/// The host's prefill and decoding of `request`; with `apart`, decoding timed in a second run
/// from the prompt's first token alone.
fn run_host(model: &Gemma4, request: &Request, apart: bool) -> Result<Throughput, BenchError> {
    if !apart {
        let g = generate(model, request, |_| {})?;
        return Ok(Throughput {
            prefill_tokens_per_s: g.stats.prefill_tokens_per_s,
            decode_tokens_per_s: g.stats.decode_tokens_per_s,
        });
    }
    let prefill = generate(model, &Request { max_tokens: 1, ..request.clone() }, |_| {})?;
    let decode = generate(model, &Request { prompt: request.prompt[..1].to_vec(), ..request.clone() }, |_| {})?;
    Ok(Throughput {
        prefill_tokens_per_s: prefill.stats.prefill_tokens_per_s,
        decode_tokens_per_s: decode.stats.decode_tokens_per_s,
    })
}

fn run_mlx_lm(
    python: &std::path::Path,
    model_dir: &std::path::Path,
    request: &Request,
) -> Result<Throughput, BenchError> {
    let ids: Vec<String> = request.prompt.iter().map(u32::to_string).collect();
    let mut command = std::process::Command::new(python);
    command
        .arg("-c")
        .arg(MLX_LM_DECODE)
        .arg("--model")
        .arg(model_dir)
        .arg("--prompt-ids")
        .arg(ids.join(","))
        .arg("--max-tokens")
        .arg(request.max_tokens.to_string());
    let shown = format!("{} mlx_lm_decode.py", python.display());
    let failed = |reason: String| BenchError::Reference { command: shown.clone(), reason };
    let out = crate::runtime::starting_children(|| command.output()).map_err(|e| failed(e.to_string()))?;
    if !out.status.success() {
        return Err(failed(String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("failed").to_owned()));
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let json: serde_json::Value = stdout
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .ok_or_else(|| failed(format!("no JSON in its output: {stdout}")))?;
    let field = |k: &str| json[k].as_f64().ok_or_else(|| failed(format!("no `{k}` in {json}")));
    Ok(Throughput {
        prefill_tokens_per_s: field("prefill_tokens_per_s")?,
        decode_tokens_per_s: field("decode_tokens_per_s")?,
    })
}

/// llama.cpp's `llama-bench` on `gguf`: prefill of `prompt_tokens` and decoding of
/// `max_tokens`, each timed by llama-bench once (after its own warm-up run), as one JSON array.
fn run_llama_bench(
    llama_bench: &std::path::Path,
    gguf: &std::path::Path,
    threads: usize,
    args: &[String],
    prompt_tokens: usize,
    max_tokens: usize,
) -> Result<Throughput, BenchError> {
    let mut command = std::process::Command::new(llama_bench);
    command.arg("-m").arg(gguf).args(["-t", &threads.to_string(), "-r", "1", "-o", "json"]);
    command.args(["-p", &prompt_tokens.to_string(), "-n", &max_tokens.to_string()]).args(args);
    let shown = format!("{} -m {}", llama_bench.display(), gguf.display());
    let failed = |reason: String| BenchError::Reference { command: shown.clone(), reason };
    let out = crate::runtime::starting_children(|| command.output()).map_err(|e| failed(e.to_string()))?;
    if !out.status.success() {
        // A failed assertion is followed by a backtrace: the assertion says what went wrong.
        let stderr = String::from_utf8_lossy(&out.stderr);
        let said = |l: &&str| ["error", "failed", "abort"].iter().any(|w| l.to_lowercase().contains(w));
        // A crash says nothing on stderr: the exit status names the signal.
        let status = out.status.to_string();
        let line = stderr.lines().find(said).or_else(|| stderr.lines().last()).unwrap_or(&status);
        return Err(failed(line.trim().to_owned()));
    }
    let tests: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)
        .map_err(|e| failed(format!("its output is not llama-bench's JSON array ({e})")))?;
    let rate = |prefill: bool| {
        tests
            .iter()
            .find(|t| (t["n_prompt"].as_u64().unwrap_or(0) > 0) == prefill)
            .and_then(|t| t["avg_ts"].as_f64())
            .ok_or_else(|| {
                failed(format!("no {} test with `avg_ts` in its output", ["decode", "prefill"][prefill as usize]))
            })
    };
    Ok(Throughput { prefill_tokens_per_s: rate(true)?, decode_tokens_per_s: rate(false)? })
}

/// Read bandwidth of `threads` threads, each summing its share of one buffer at once (the
/// best of three), over a buffer as [`memory_bandwidth_gb_per_s`]'s. The threads inherit the
/// caller's cores: for more than one, start it where they may run on every core
/// ([`crate::runtime::starting_children`]).
pub fn memory_bandwidth_gb_per_s_threads(threads: usize) -> f64 {
    let words = (2 * largest_cache_bytes().unwrap_or(0)).max(256 << 20) / 8;
    let data: Vec<u64> = (0..words as u64).collect();
    let share = words.div_ceil(threads.max(1));
    let mut best = f64::MAX;
    for _ in 0..3 {
        let start = Instant::now();
        std::thread::scope(|scope| {
            for part in data.chunks(share) {
                scope.spawn(move || std::hint::black_box(sum_words(part)));
            }
        });
        best = best.min(start.elapsed().as_secs_f64());
    }
    (words * 8) as f64 / best / 1e9
}

/// The words' sum in four independent chains, so that the loads, not the adds, are the limit.
fn sum_words(data: &[u64]) -> [u64; 4] {
    let mut acc = [0u64; 4];
    for chunk in data.chunks_exact(4) {
        for (a, x) in acc.iter_mut().zip(chunk) {
            *a = a.wrapping_add(*x);
        }
    }
    acc
}

/// Single-thread read bandwidth of this machine's memory: the best of three sums over a buffer
/// twice its largest cache (at least 256 MiB). A server's last-level cache can hold 256 MiB, and
/// a sum over that read the cache, not memory.
pub fn memory_bandwidth_gb_per_s() -> f64 {
    memory_bandwidth_gb_per_s_threads(1)
}

/// The largest cache Linux reports for the first CPU (`/sys/devices/system/cpu/cpu0/cache`).
fn largest_cache_bytes() -> Option<usize> {
    let caches = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    caches
        .filter_map(|cache| std::fs::read_to_string(cache.ok()?.path().join("size")).ok())
        .filter_map(|size| cache_size_bytes(size.trim()))
        .max()
}

/// A cache size as sysfs writes it ("48K", "2048K", "480M").
fn cache_size_bytes(size: &str) -> Option<usize> {
    let (digits, unit) = size.split_at(size.find(|c: char| !c.is_ascii_digit()).unwrap_or(size.len()));
    let scale = match unit {
        "" => 1,
        "K" => 1 << 10,
        "M" => 1 << 20,
        "G" => 1 << 30,
        _ => return None,
    };
    digits.parse::<usize>().ok().map(|n| n * scale)
}

/// Median and range of a sample, for printing.
pub fn summary(values: &[f64]) -> (f64, f64, f64) {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let median = if v.is_empty() { 0.0 } else { v[v.len() / 2] };
    (median, v.first().copied().unwrap_or(0.0), v.last().copied().unwrap_or(0.0))
}

/// Plain against speculative decoding of one request, paired and interleaved.
#[derive(Debug, serde::Serialize)]
pub struct SpeculativeBench {
    /// Seconds per generation (prefill and decode).
    pub plain_s: Vec<f64>,
    pub speculative_s: Vec<f64>,
    /// plain time / speculative time per pair: above 1 is a speed-up.
    pub speedups: Vec<f64>,
    /// Whether every speculative output equalled the plain one.
    pub identical: bool,
    /// The statistics of the last speculative run.
    pub stats: crate::generate::Stats,
    pub plain_forwards: usize,
}

pub fn speculative(
    model: &std::rc::Rc<Gemma4>,
    drafter: &crate::plugin::LoadedDrafter,
    request: &Request,
    config: crate::speculative::SpecConfig,
    pairs: usize,
) -> Result<SpeculativeBench, GenerateError> {
    let timed_plain = || -> Result<(f64, crate::generate::Generation), GenerateError> {
        let start = Instant::now();
        let g = generate(model, request, |_| {})?;
        Ok((start.elapsed().as_secs_f64(), g))
    };
    let timed_spec = || -> Result<(f64, crate::generate::Generation), GenerateError> {
        let start = Instant::now();
        let g = crate::speculative::generate_speculative(model, drafter, request, config, |_| {})?;
        Ok((start.elapsed().as_secs_f64(), g))
    };
    timed_plain()?;
    timed_spec()?;
    let (mut plain_s, mut speculative_s) = (Vec::new(), Vec::new());
    let mut identical = true;
    let mut last = None;
    for pair in 0..pairs {
        let ((p, plain), (s, spec)) = if pair % 2 == 0 {
            let p = timed_plain()?;
            (p, timed_spec()?)
        } else {
            let s = timed_spec()?;
            (timed_plain()?, s)
        };
        identical &= plain.tokens == spec.tokens;
        plain_s.push(p);
        speculative_s.push(s);
        last = Some((plain.stats.target_forwards, spec.stats));
    }
    let (plain_forwards, stats) = last.unwrap_or_default();
    Ok(SpeculativeBench {
        speedups: plain_s.iter().zip(&speculative_s).map(|(p, s)| p / s).collect(),
        plain_s,
        speculative_s,
        identical,
        stats,
        plain_forwards,
    })
}

#[cfg(test)]
mod tests {
    use super::cache_size_bytes;

    #[test]
    fn cache_sizes_read_as_sysfs_writes_them() {
        assert_eq!(cache_size_bytes("48K"), Some(48 << 10));
        assert_eq!(cache_size_bytes("491520K"), Some(480 << 20));
        assert_eq!(cache_size_bytes("2M"), Some(2 << 20));
        assert_eq!(cache_size_bytes("512"), Some(512));
        assert_eq!(cache_size_bytes("12X"), None);
        assert_eq!(cache_size_bytes("K"), None);
    }
}

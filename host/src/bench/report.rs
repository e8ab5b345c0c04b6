//! `host bench` as the command line runs it: the manifest's target (and drafter) loaded, the
//! request resolved, the measurement chosen by whether the manifest has a drafter, and the
//! report rendered as text or JSON.

use std::path::PathBuf;
use std::rc::Rc;

use super::{plain, speculative, summary, BenchConfig, BenchError, PlainBench, Reference, SpeculativeBench};
use crate::generate::Request;
use crate::manifest::{DraftTokens, Manifest};
use crate::model::Gemma4;
use crate::plugin::LoadedDrafter;
use crate::plugins_dir::PluginsDir;
use crate::run::{load_drafter, resolve_request, spec_config, CheckpointDefaults, Overrides, RunError};
use crate::speculative::{describe_draft_tokens, probe_open, SpecConfig};
use crate::tokenizer::Tokenizer;

/// Where `host bench` finds a Python with mlx-lm when `--mlx-lm-python` is not given.
pub const MLX_LM_PYTHON_ENV: &str = "HOST_MLX_LM_PYTHON";

#[derive(Debug, Clone)]
pub struct BenchOptions {
    pub manifest: PathBuf,
    pub pairs: usize,
    pub max_tokens: u32,
    pub mlx_lm_python: Option<PathBuf>,
    /// Time the host alone (`--no-mlx-lm`).
    pub no_mlx_lm: bool,
    /// Measure against llama.cpp instead: its `llama-bench` and a GGUF of the same checkpoint.
    pub llama_cpp: Option<(PathBuf, PathBuf)>,
    /// More arguments for llama-bench.
    pub llama_bench_args: Vec<String>,
    /// A prompt of this many tokens instead of the manifest's (what prefill is timed on).
    pub prompt_tokens: Option<usize>,
    pub plugins_dir: PluginsDir,
    /// Measure the serving engine at these concurrencies instead (`--serving`).
    pub serving: Option<Vec<usize>>,
    /// Requests per serving run.
    pub requests: usize,
    /// Overrides the manifest's draft length.
    pub draft_tokens: Option<DraftTokens>,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchRunError {
    /// Loading the manifest's target, drafter or request, as `host run` does.
    #[error(transparent)]
    Setup(#[from] RunError),
    #[error(transparent)]
    Bench(#[from] BenchError),
    #[error(
        "plain decoding is measured against mlx-lm: give --mlx-lm-python PATH or set {MLX_LM_PYTHON_ENV} \
         to a Python with mlx-lm (`make oracle` makes tests/oracle/.venv/bin/python)"
    )]
    NoMlxLm,
    #[error("--pairs: must be at least 1")]
    NoPairs,
    #[error("--serving compares plain and speculative decoding: the manifest needs a [drafter]")]
    ServingWithoutDrafter,
    #[error("--serving: concurrencies and --requests must be at least 1")]
    NoServing,
}

/// What was measured, with what it was measured on.
#[derive(Debug, serde::Serialize)]
#[serde(untagged)]
pub enum BenchReport {
    Plain {
        #[serde(skip)]
        prompt_tokens: usize,
        #[serde(skip)]
        max_tokens: usize,
        #[serde(flatten)]
        result: PlainBench,
    },
    Speculative {
        #[serde(skip)]
        kind: String,
        /// "4", or "auto (up to 8)".
        #[serde(skip)]
        draft_tokens: String,
        #[serde(skip)]
        prompt_tokens: usize,
        #[serde(skip)]
        max_tokens: usize,
        #[serde(flatten)]
        result: SpeculativeBench,
    },
    Serving(super::ServingBench),
}

pub fn bench(options: &BenchOptions) -> Result<BenchReport, BenchRunError> {
    if options.pairs == 0 {
        return Err(BenchRunError::NoPairs);
    }
    let (manifest, model, request, drafter) = setup(options)?;
    let (prompt_tokens, max_tokens) = (request.prompt.len(), request.max_tokens);
    if let Some(concurrencies) = &options.serving {
        let Some((drafter, config)) = drafter else { return Err(BenchRunError::ServingWithoutDrafter) };
        if concurrencies.contains(&0) || options.requests == 0 {
            return Err(BenchRunError::NoServing);
        }
        let requests = distinct_requests(&request, options.requests);
        let result = super::serving::serving(&model, &drafter, config, &requests, concurrencies, options.pairs)
            .map_err(BenchError::Generate)?;
        return Ok(BenchReport::Serving(result));
    }
    if let Some((drafter, config)) = drafter {
        let result = speculative(&model, &drafter, &request, config, options.pairs).map_err(BenchError::Generate)?;
        let kind = drafter.kind().to_owned();
        return Ok(BenchReport::Speculative {
            kind,
            draft_tokens: describe_draft_tokens(config.auto, config.draft_tokens),
            prompt_tokens,
            max_tokens,
            result,
        });
    }
    let reference = match (&options.llama_cpp, options.no_mlx_lm) {
        (Some((llama_bench, gguf)), _) => Some(Reference::LlamaCpp {
            llama_bench: llama_bench.clone(),
            gguf: gguf.clone(),
            threads: crate::runtime::process_cpus().len().max(1),
            args: options.llama_bench_args.clone(),
        }),
        (None, true) => None,
        (None, false) => Some(Reference::MlxLm(
            options
                .mlx_lm_python
                .clone()
                .or_else(|| std::env::var_os(MLX_LM_PYTHON_ENV).map(PathBuf::from))
                .ok_or(BenchRunError::NoMlxLm)?,
        )),
    };
    let config = BenchConfig { pairs: options.pairs, reference };
    let result = plain(&model, &manifest.target_model, &request, &config)?;
    Ok(BenchReport::Plain { prompt_tokens, max_tokens, result })
}

/// `n` requests with distinct prompts: the manifest's prompt cut to lengths spread over its
/// second half.
fn distinct_requests(request: &Request, n: usize) -> Vec<Request> {
    let len = request.prompt.len();
    (0..n)
        .map(|i| {
            let keep = (len - i * len / (2 * n)).max(2.min(len));
            Request { prompt: request.prompt[..keep].to_vec(), ..request.clone() }
        })
        .collect()
}

/// A prompt of `n` tokens: the manifest's first token (BOS), then ids stepping through the
/// vocabulary, as mlx_lm_decode.py builds its fixed prompt.
fn synthetic_prompt(n: usize, vocab: usize, first: Option<u32>) -> Vec<u32> {
    const FROM: usize = 10;
    let span = vocab.saturating_sub(FROM).max(1);
    let tail = (0..n.saturating_sub(1)).map(|i| (FROM + (i * 7919) % span) as u32);
    first.into_iter().chain(tail).take(n).collect()
}

type Setup = (Manifest, Rc<Gemma4>, Request, Option<(LoadedDrafter, SpecConfig)>);

/// The manifest's target, its greedy request of exactly `max_tokens` (no EOS stop, so both
/// sides generate the same length) and its drafter, opened against the target.
fn setup(options: &BenchOptions) -> Result<Setup, RunError> {
    let manifest = Manifest::load(&options.manifest)?;
    let model = Rc::new(crate::model::load(&manifest.target_model)?);
    let tokenizer = Tokenizer::load(&manifest.target_model)?;
    let overrides = Overrides { max_tokens: Some(options.max_tokens), temperature: Some(0.0), ..Overrides::default() };
    let mut request = resolve_request(&manifest, &overrides, &model, &tokenizer, &CheckpointDefaults::default())?;
    request.eos.clear();
    if let Some(n) = options.prompt_tokens {
        request.prompt = synthetic_prompt(n, model.config.vocab_size as usize, request.prompt.first().copied());
    }
    let mut drafter = load_drafter(&manifest, &options.plugins_dir)?;
    if let Some((d, config)) = &mut drafter {
        probe_open(&model, d)?;
        if let Some(n) = options.draft_tokens {
            *config = SpecConfig { tree_nodes: config.tree_nodes, ..spec_config(n, config.verify, &d.info) };
        }
    }
    Ok((manifest, model, request, drafter))
}

impl BenchReport {
    pub fn text(&self) -> String {
        match self {
            BenchReport::Plain { prompt_tokens, max_tokens, result } => plain_text(*prompt_tokens, *max_tokens, result),
            BenchReport::Speculative { kind, draft_tokens, prompt_tokens, max_tokens, result } => {
                speculative_text(kind, draft_tokens, *prompt_tokens, *max_tokens, result)
            }
            BenchReport::Serving(result) => result.text(),
        }
    }
}

fn plain_text(prompt_tokens: usize, max_tokens: usize, r: &PlainBench) -> String {
    let stat = |v: Vec<f64>| summary(&v);
    let (hd, _, _) = stat(r.host.iter().map(|t| t.decode_tokens_per_s).collect());
    let (md, _, _) = stat(r.reference.iter().map(|t| t.decode_tokens_per_s).collect());
    let (hp, _, _) = stat(r.host.iter().map(|t| t.prefill_tokens_per_s).collect());
    let (mp, _, _) = stat(r.reference.iter().map(|t| t.prefill_tokens_per_s).collect());
    let (dr, dr_lo, dr_hi) = summary(&r.decode_ratios);
    let (pr, pr_lo, pr_hi) = summary(&r.prefill_ratios);
    let route = match r.host_route.as_str() {
        "mlx" => "MLX's ops (the mlx route)".to_owned(),
        loops => format!("{loops} loops"),
    };
    let rates = match &r.reference_name {
        None => format!(
            "plain decoding, {prompt_tokens} prompt tokens, {max_tokens} generated, {} runs (median; host alone; {route})\n\
             \x20 decode   host {hd:8.1} tok/s\n\
             \x20 prefill  host {hp:8.1} tok/s\n",
            r.host.len()
        ),
        Some(name) => format!(
            "plain decoding, {prompt_tokens} prompt tokens, {max_tokens} generated, {} pairs (median; ratio range; host on {route})\n\
             \x20 decode   host {hd:8.1} tok/s   {name} {md:8.1} tok/s   ratio {dr:.3}x  [{dr_lo:.3}, {dr_hi:.3}]\n\
             \x20 prefill  host {hp:8.1} tok/s   {name} {mp:8.1} tok/s   ratio {pr:.3}x  [{pr_lo:.3}, {pr_hi:.3}]\n",
            r.host.len()
        ),
    };
    let two_threads = match (r.memory_gb_per_s_two_threads, r.host_share_of_two_threads) {
        (Some(bw), Some(host)) => {
            let reference = match (&r.reference_name, r.reference_share_of_two_threads) {
                (Some(name), Some(share)) => format!(", {name} {:.0}%", 100.0 * share),
                _ => String::new(),
            };
            format!("  two threads read {bw:.1} GB/s; decode reads at host {:.0}%{reference} of it\n", 100.0 * host)
        }
        _ => String::new(),
    };
    format!(
        "{rates}\
         \x20 {}\n\
         {two_threads}\
         \x20 verify window of {} tokens {:.2} ms, one-token step {:.2} ms: {:.2}x a step (median)\n\
         {}",
        match (r.bandwidth_bound_tokens_per_s, r.memory_gb_per_s) {
            (Some(bound), Some(gb_per_s)) => format!(
                "bandwidth bound {bound:.1} tok/s ({:.1} MB of weights per token at {gb_per_s:.1} GB/s measured); host decode at {:.0}% of it",
                r.weight_bytes_per_token as f64 / 1e6,
                100.0 * hd / bound
            ),
            _ => "bandwidth bound not measured: MLX runs on another device than the CPU whose memory this measures".into(),
        },
        super::WINDOW,
        r.window_ms,
        r.step_ms,
        r.window_over_step,
        sampling_text(&r.sampling, r.step_ms),
    )
}

/// Each setting's cost of choosing a token, and its share of a one-token step.
fn sampling_text(rows: &[super::SamplingRow], step_ms: f64) -> String {
    rows.iter()
        .map(|r| {
            format!(
                "  sampling ({}) {:.2} ms: {:.1}% of a step\n",
                r.settings,
                r.milliseconds,
                100.0 * r.milliseconds / step_ms
            )
        })
        .collect()
}

fn speculative_text(
    kind: &str,
    draft_tokens: &str,
    prompt_tokens: usize,
    max_tokens: usize,
    r: &SpeculativeBench,
) -> String {
    let (speedup, lo, hi) = summary(&r.speedups);
    let (p, _, _) = summary(&r.plain_s);
    let (s, _, _) = summary(&r.speculative_s);
    let st = &r.stats;
    let by_position: Vec<String> = st.accepted_by_position.iter().map(|a| format!("{a:.2}")).collect();
    format!(
        "speculative ({kind}, {draft_tokens} draft tokens) vs plain, {prompt_tokens} prompt tokens, {max_tokens} generated, {} pairs\n\
         \x20 wall clock   plain {p:.3} s   speculative {s:.3} s   speed-up {speedup:.3}x  [{lo:.3}, {hi:.3}]\n\
         \x20 tau {:.2} (mean tokens per round), acceptance {:.1}%, by position [{}]\n\
         \x20 target forwards: plain {}, speculative {} ({} rounds, {} drafted, {} accepted); outputs identical: {}\n",
        r.speedups.len(),
        st.mean_accept_len,
        100.0 * st.acceptance_rate,
        by_position.join(", "),
        r.plain_forwards,
        st.target_forwards,
        st.rounds,
        st.drafted,
        st.accepted,
        if r.identical { "yes" } else { "NO" }
    )
}

#[cfg(test)]
mod tests {
    use super::super::{PlainBench, Throughput};

    fn bench(memory_gb_per_s: Option<f64>) -> PlainBench {
        let run = Throughput { prefill_tokens_per_s: 400.0, decode_tokens_per_s: 100.0 };
        PlainBench {
            host_route: "avx2".into(),
            host: vec![run; 2],
            reference_name: Some("mlx-lm".into()),
            reference: vec![run; 2],
            decode_ratios: vec![1.0; 2],
            prefill_ratios: vec![1.0; 2],
            weight_bytes_per_token: 20_000_000,
            memory_gb_per_s,
            bandwidth_bound_tokens_per_s: memory_gb_per_s.map(|m| m * 1e9 / 20e6),
            memory_gb_per_s_two_threads: memory_gb_per_s.map(|m| 2.0 * m),
            host_share_of_two_threads: memory_gb_per_s.map(|m| 20e6 * 100.0 / (2.0 * m * 1e9)),
            reference_share_of_two_threads: None,
            step_ms: 10.0,
            window_ms: 15.0,
            window_over_step: 1.5,
            sampling: Vec::new(),
        }
    }

    #[test]
    fn the_bandwidth_bound_is_the_cpus_and_left_out_off_it() {
        let on_cpu = super::plain_text(8, 32, &bench(Some(10.0)));
        assert!(on_cpu.contains("bandwidth bound 500.0 tok/s (20.0 MB of weights per token at 10.0 GB/s measured); host decode at 20% of it"), "{on_cpu}");
        let elsewhere = super::plain_text(8, 32, &bench(None));
        assert!(elsewhere.contains("bandwidth bound not measured: MLX runs on another device"), "{elsewhere}");
    }

    #[test]
    fn the_share_of_two_threads_names_each_program_measured() {
        let mut paired = bench(Some(10.0));
        paired.reference_name = Some("llama.cpp".into());
        paired.reference_share_of_two_threads = Some(0.5);
        let text = super::plain_text(512, 128, &paired);
        assert!(text.contains("two threads read 20.0 GB/s; decode reads at host 10%, llama.cpp 50% of it"), "{text}");
        assert!(text.contains("llama.cpp    100.0 tok/s   ratio 1.000x"), "{text}");
    }

    #[test]
    fn a_synthetic_prompt_keeps_the_first_token_and_stays_in_the_vocabulary() {
        let prompt = super::synthetic_prompt(512, 300, Some(2));
        assert_eq!(prompt.len(), 512);
        assert_eq!(prompt[0], 2);
        assert!(prompt[1..].iter().all(|&t| (10..300).contains(&t)), "{prompt:?}");
        assert_eq!(super::synthetic_prompt(1, 300, Some(2)), vec![2]);
    }

    #[test]
    fn without_mlx_lm_only_the_hosts_rates_are_shown() {
        let paired = super::plain_text(8, 32, &bench(Some(10.0)));
        assert!(paired.contains("decode   host    100.0 tok/s   mlx-lm    100.0 tok/s   ratio 1.000x"), "{paired}");
        let alone = PlainBench {
            reference_name: None,
            reference: Vec::new(),
            decode_ratios: Vec::new(),
            prefill_ratios: Vec::new(),
            ..bench(Some(10.0))
        };
        let text = super::plain_text(8, 32, &alone);
        assert!(text.contains("2 runs (median; host alone; avx2 loops)\n  decode   host    100.0 tok/s\n"), "{text}");
        assert!(!text.contains("ratio"), "{text}");
        assert!(text.contains("verify window of 5 tokens 15.00 ms, one-token step 10.00 ms: 1.50x a step"), "{text}");
    }
}

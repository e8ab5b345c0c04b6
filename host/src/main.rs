use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};

use std::io::{IsTerminal, Write};

use host::bench::BenchOptions;
use host::generate::Flow;
use host::manifest::{Manifest, Source};
use host::plugin::{load, report, Registry};
use host::run::{load_drafter, Overrides, RunEvent, RunOptions};
use host::{doctor, plugins_dir};
use indicatif::{ProgressBar, ProgressStyle};

/// Lossless speculative decoding of Gemma 4 with drafters loaded as plugins.
#[derive(Parser)]
#[command(name = "host", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// More detail: the full report behind a plugin's refusal, a drafter's panic message and
    /// backtrace.
    #[arg(long, short, global = true)]
    verbose: bool,
    /// Only the output and errors: no summaries, warnings or progress on stderr.
    #[arg(long, short, global = true, conflicts_with = "verbose")]
    quiet: bool,
}

#[derive(Args)]
struct PluginsDir {
    /// Where drafter plugins are looked for (default: the manifest's `[drafter] plugins_dir`,
    /// else $HOST_PLUGINS_DIR, else the directory of this executable).
    #[arg(long, value_name = "DIR", global = true)]
    plugins_dir: Option<PathBuf>,
}

/// What to load: a manifest, or a model (and drafter) named on the command line.
#[derive(Args)]
struct SourceArgs {
    /// The manifest: target, drafter, generation (and serving) settings.
    #[arg(long, value_name = "FILE", required_unless_present = "model")]
    manifest: Option<PathBuf>,
    /// The target: a directory, or a Hugging Face model id (ORG/NAME[@REVISION]) found in the
    /// local cache (overrides the manifest's).
    #[arg(long, short = 'm', value_name = "PATH|ID")]
    model: Option<String>,
    /// A drafter kind from the plugins directory (overrides the manifest's).
    #[arg(long, value_name = "KIND")]
    drafter: Option<String>,
    /// The drafter's checkpoint directory.
    #[arg(long, value_name = "DIR")]
    drafter_artifact: Option<PathBuf>,
}

impl From<SourceArgs> for Source {
    fn from(a: SourceArgs) -> Source {
        Source { manifest: a.manifest, model: a.model, drafter: a.drafter, drafter_artifact: a.drafter_artifact }
    }
}

#[derive(Args)]
#[command(allow_negative_numbers = true)]
struct RunArgs {
    #[command(flatten)]
    source: SourceArgs,
    /// Prompt text (overrides the manifest's).
    #[arg(long, conflicts_with = "prompt_ids")]
    prompt: Option<String>,
    /// Many requests, one JSON object per line (`prompt` or `prompt_ids`, optional `max_tokens`,
    /// `temperature`, `seed`, `id`); one result line each, in input order.
    #[arg(long, value_name = "FILE", conflicts_with_all = ["prompt", "prompt_ids", "json"])]
    prompts_file: Option<PathBuf>,
    /// Where --prompts-file results go (default: stdout).
    #[arg(long, value_name = "FILE", requires = "prompts_file")]
    output: Option<PathBuf>,
    /// Prompt as token ids, comma-separated.
    #[arg(long, value_delimiter = ',', value_name = "IDS")]
    prompt_ids: Option<Vec<u32>>,
    /// Wrap a text prompt as one user turn in the checkpoint's chat template (Gemma's turn
    /// format when it ships none).
    #[arg(long, conflicts_with = "prompt_ids")]
    chat: bool,
    #[arg(long, value_name = "N")]
    max_tokens: Option<u32>,
    #[arg(long, value_name = "T")]
    temperature: Option<f32>,
    #[arg(long, value_name = "P")]
    top_p: Option<f32>,
    #[arg(long, value_name = "K")]
    top_k: Option<u32>,
    #[arg(long, value_name = "P")]
    min_p: Option<f32>,
    #[arg(long, value_name = "S")]
    seed: Option<u64>,
    /// Subtracted from a token's logit per time it was generated, -2 to 2 (OpenAI's).
    #[arg(long, value_name = "F")]
    frequency_penalty: Option<f32>,
    /// Subtracted from a token's logit once it was generated, -2 to 2 (OpenAI's).
    #[arg(long, value_name = "F")]
    presence_penalty: Option<f32>,
    /// Divides the positive logits (multiplies the negative) of the last tokens (mlx-lm's).
    #[arg(long, value_name = "R")]
    repetition_penalty: Option<f32>,
    /// How many of the last tokens --repetition-penalty looks at (default 20).
    #[arg(long, value_name = "N")]
    repetition_context_size: Option<usize>,
    /// Biases added to tokens' logits, -100 to 100: ID=BIAS,… (-100 bans a token).
    #[arg(long, value_delimiter = ',', value_name = "ID=BIAS", value_parser = parse_logit_bias)]
    logit_bias: Option<Vec<(u32, f32)>>,
    /// Each token's log-probability and its N most likely alternatives (0 to 20), in the --json
    /// output and the --prompts-file results.
    #[arg(long, value_name = "N")]
    logprobs: Option<usize>,
    /// Tokens the drafter proposes per round (overrides the manifest's).
    #[arg(long, value_name = "N")]
    draft_tokens: Option<u32>,
    /// Print one JSON object at the end instead of streaming text.
    #[arg(long)]
    json: bool,
    /// After the text, the statistics (speculation included) as a table on stderr.
    #[arg(long, conflicts_with = "json")]
    stats: bool,
    /// With a drafter: decode the same request plainly afterwards and say how much faster the
    /// speculative run was, and whether the outputs are identical.
    #[arg(long)]
    compare_plain: bool,
    #[command(flatten)]
    dir: PluginsDir,
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    source: SourceArgs,
    /// Tokens the drafter proposes per round, the most a request may ask for.
    #[arg(long, value_name = "N")]
    draft_tokens: Option<u32>,
    /// Address to listen on (default: the manifest's [server] host, else 127.0.0.1: only this
    /// machine can connect).
    #[arg(long)]
    host: Option<String>,
    /// Port to listen on (default: the manifest's, else 8080; 0: any free port, printed at start).
    #[arg(long)]
    port: Option<u16>,
    /// Require `Authorization: Bearer KEY` on every endpoint but /health (default:
    /// $HOST_API_KEY, else the manifest's).
    #[arg(long, value_name = "KEY", env = "HOST_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// Requests decoded together at most (default: the manifest's, else 8).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=256))]
    max_batch: Option<u32>,
    /// Requests waiting at most; more are answered 429 (default: the manifest's, else 64).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    max_queue: Option<u32>,
    /// MiB of target caches kept for prompts that later prompts extend; 0: no prefix cache
    /// (default: the manifest's, else 256).
    #[arg(long, value_name = "MB")]
    prefix_cache_mb: Option<u32>,
    #[command(flatten)]
    dir: PluginsDir,
}

#[derive(Args)]
struct BenchArgs {
    #[arg(long, value_name = "FILE", required_unless_present_any = ["kernels", "sweep", "collectives"])]
    manifest: Option<PathBuf>,
    /// Time the collectives of a tensor-parallel target (all_sum of a hidden state, all_gather
    /// of a slice of logits) between ranks: `host launch -n 2 -- bench --collectives`.
    #[arg(long, conflicts_with_all = ["kernels", "sweep", "serving", "manifest"])]
    collectives: bool,
    /// Time the manifest's request in one process against the target sharded over this many
    /// ranks on this machine (`host launch`), paired and interleaved.
    #[arg(long, value_name = "N", conflicts_with_all = ["kernels", "sweep", "serving", "collectives"])]
    ranks: Option<usize>,
    /// Time drafters instead: these manifests (one target, each with a [drafter]) at every
    /// --draft-tokens length on every prompt of --prompts-file, against plain decoding.
    #[arg(long, value_delimiter = ',', value_name = "FILE,FILE,...", conflicts_with_all = ["kernels", "manifest", "serving"], requires = "prompts_file")]
    sweep: Option<Vec<PathBuf>>,
    /// The sweep's prompts: one JSON object per line with a `prompt` (and an optional `id`).
    #[arg(long, value_name = "FILE", requires = "sweep")]
    prompts_file: Option<PathBuf>,
    /// Adds sampled runs at this temperature to the sweep's greedy ones, verified both by
    /// `match` and, for drafters that return probabilities, by `rejection`.
    #[arg(long, requires = "sweep")]
    temperature: Option<f32>,
    /// The draft lengths of the sweep's sampled runs (default: those of --draft-tokens).
    #[arg(long, value_delimiter = ',', value_name = "N,N,...", requires = "temperature")]
    sampled_draft_tokens: Vec<host::manifest::DraftTokens>,
    /// Nucleus mass of the sweep's sampled runs.
    #[arg(long, default_value_t = 0.95, requires = "temperature")]
    top_p: f32,
    /// Draws the sweep's speed-up against draft length, per drafter and mode, as a PNG.
    #[arg(long, value_name = "FILE.png", requires = "sweep")]
    plot: Option<PathBuf>,
    /// Times each drafter at each draft length both as a chain and as a tree of as many drafts
    /// (the same verify width), whatever its manifest's tree_nodes; the trees' rows are named
    /// "<manifest> trees".
    #[arg(long, requires = "sweep")]
    equal_width_trees: bool,
    /// Time the CPU products of one to sixteen rows per weight format, the host's against
    /// MLX's, next to the machine's read bandwidth (needs no manifest).
    #[arg(long)]
    kernels: bool,
    /// Time the serving engine instead: aggregate tokens/s with this many requests in flight
    /// (comma-separated concurrencies), plain against speculative.
    #[arg(long, value_delimiter = ',', value_name = "N,N,...", conflicts_with = "kernels")]
    serving: Option<Vec<usize>>,
    /// Requests per serving run (distinct prompts: the manifest's, cut to different lengths).
    #[arg(long, default_value_t = 16, requires = "serving")]
    requests: usize,
    /// Tokens the drafter proposes per round, 1 to 64 or `auto` (overrides the manifest's);
    /// with --sweep, a comma-separated list of lengths to time.
    #[arg(long, value_delimiter = ',', value_name = "N")]
    draft_tokens: Vec<host::manifest::DraftTokens>,
    /// Measured pairs (host, mlx-lm), run in alternating order.
    #[arg(long, default_value_t = 6)]
    pairs: usize,
    /// Tokens generated per run.
    #[arg(long, default_value_t = 128)]
    max_tokens: u32,
    /// A Python with mlx-lm installed, for plain decoding's reference (default:
    /// $HOST_MLX_LM_PYTHON; `make oracle` makes tests/oracle/.venv/bin/python).
    #[arg(long, value_name = "PATH")]
    mlx_lm_python: Option<PathBuf>,
    /// Time the host alone, without mlx-lm's reference runs: on a large quantized model its CPU
    /// kernels take seconds per token.
    #[arg(long, conflicts_with = "mlx_lm_python")]
    no_mlx_lm: bool,
    /// Measure plain decoding against llama.cpp instead of mlx-lm: its `llama-bench` binary, run
    /// on --gguf at as many threads as the host has cores (`make bench-llamacpp` builds both).
    /// Both decode from an empty context, apart from the prefill: the host from the prompt's
    /// first token.
    #[arg(long, value_name = "PATH", requires = "gguf", conflicts_with_all = ["mlx_lm_python", "no_mlx_lm"])]
    llama_bench: Option<PathBuf>,
    /// The GGUF conversion of the manifest's target that --llama-bench runs.
    #[arg(long, value_name = "FILE", requires = "llama_bench")]
    gguf: Option<PathBuf>,
    /// More arguments for llama-bench, as one string (`"--repack 0"`: where llama.cpp's AMX
    /// path crashes, docs/performance.md).
    #[arg(long, value_name = "ARGS", requires = "llama_bench", allow_hyphen_values = true)]
    llama_bench_args: Option<String>,
    /// A prompt of this many tokens (the first one the manifest's, then ids stepping through
    /// the vocabulary) in place of the manifest's: what prefill is timed on.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    prompt_tokens: Option<u32>,
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    dir: PluginsDir,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text for a manifest's prompt, streaming it as it comes.
    Run(RunArgs),
    /// Time plain decoding against mlx-lm on the manifest's target or, for a manifest with a
    /// [drafter], plain against speculative decoding (--sweep: several drafters at several
    /// draft lengths on a file of prompts); paired and interleaved.
    Bench(BenchArgs),
    /// Serve the manifest's model over an OpenAI-compatible HTTP API (/v1/completions,
    /// /v1/chat/completions, /v1/models, /health, /metrics), batching requests as they come.
    Serve(ServeArgs),
    /// Show the MLX runtime, BLAS, device and plugins directory this process uses.
    Doctor {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        dir: PluginsDir,
    },
    /// Scan a checkpoint: NaN and Inf per tensor, then every shape and dtype against its config.
    CheckModel {
        /// A Hugging Face-format model directory.
        dir: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// List or inspect drafter plugins.
    Plugins {
        #[command(subcommand)]
        command: PluginsCommand,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions { shell: clap_complete::Shell },
    /// Write a new drafter crate (a working text-only drafter with one option, its conformance
    /// test, a manifest for the demo target, a README of the commands that build, check, run
    /// and bench it) that builds outside this checkout as it is.
    NewDrafter {
        /// The drafter's kind, which is also the crate's name: lowercase letters, digits, `_`.
        name: String,
        /// Where to write it (default: ./NAME); must not exist, or be empty.
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
        /// Also write `train.py`, which fits the drafter's artifact (a next-token table) to a
        /// target from the target's own training signal, and a manifest that names it.
        #[arg(long)]
        trainable: bool,
    },
    /// Run a command (`run …`) as N tensor-parallel ranks over MLX's ring backend: N local
    /// ranks on loopback, or one rank per entry of a ring hostfile. Only rank 0 writes output.
    Launch {
        /// Ranks to start on this machine (default 2; with --hostfile, its count).
        #[arg(short = 'n', long = "ranks", value_name = "N")]
        ranks: Option<usize>,
        /// A ring hostfile: a JSON list with one list of "ip:port" addresses per rank. Ranks on
        /// other hosts are started over ssh, with this executable and the hostfile at the same
        /// paths there.
        #[arg(long, value_name = "FILE")]
        hostfile: Option<PathBuf>,
        /// The command each rank runs, after `--` (e.g. `-- run --manifest m.toml`).
        #[arg(last = true, required = true, value_name = "COMMAND")]
        command: Vec<std::ffi::OsString>,
    },
    /// Check manifests.
    Manifest {
        #[command(subcommand)]
        command: ManifestCommand,
    },
}

#[derive(Subcommand)]
enum PluginsCommand {
    /// Every library in the plugins directory: kind, version, API version, loaded or why not.
    List {
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        dir: PluginsDir,
    },
    /// One plugin's descriptor, by kind or by library path.
    Inspect {
        /// A plugin kind (e.g. `ngram`) or the path of a library.
        plugin: String,
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        dir: PluginsDir,
    },
    /// Load a built drafter library as `run` does and check it: the conformance kit through its
    /// ABI, then against a real target, speculative output equal to plain decoding (greedy at several draft lengths, seeded
    /// sampling, rows joining and leaving a batch), then what it buys. Exit 0 only when every
    /// check holds.
    Check {
        /// The library (`lib<kind>.so`, `.dylib`, `.dll`).
        library: PathBuf,
        /// The target (default: this checkout's demo target, models/kjv-gemma4).
        #[arg(long, value_name = "DIR")]
        model: Option<PathBuf>,
        /// The drafter's artifact directory, for kinds that need one.
        #[arg(long, value_name = "DIR")]
        artifact: Option<PathBuf>,
        /// Its `[drafter.options]`, as TOML (`--options 'max_ngram = 4'`).
        #[arg(long, value_name = "TOML", default_value = "")]
        options: String,
        /// Prompts, one JSON object per line with a `prompt` (default: the first three of the
        /// target's bench-prompts.jsonl).
        #[arg(long, value_name = "FILE")]
        prompts: Option<PathBuf>,
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum ManifestCommand {
    /// Parse a manifest, check its paths, and load and configure its drafter.
    Check {
        file: PathBuf,
        #[command(flatten)]
        dir: PluginsDir,
    },
}

/// `host --version`: the host, the plugin API it speaks and the MLX it runs on.
fn version() -> &'static str {
    let text = format!(
        "{} (plugin API {}, MLX {})",
        env!("CARGO_PKG_VERSION"),
        plugin_api::API_VERSION,
        host::runtime::mlx_version()
    );
    Box::leak(text.into_boxed_str())
}

fn main() -> ExitCode {
    let matches = Cli::command().version(version()).get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if cli.verbose {
        // SAFETY: still single-threaded: the runtime and any plugin start later.
        unsafe { std::env::set_var(plugin_api::sdk::PANIC_OUTPUT_ENV, "1") };
    }
    host::runtime::init_process();
    // A rank started by `host launch`: rank 0 speaks for all, the others only report errors.
    let rank = std::env::var_os(host::distributed::HOSTFILE_ENV)
        .map(|_| std::env::var(host::distributed::RANK_ENV).unwrap_or_default());
    match run(cli, rank.as_deref().is_some_and(|r| r.trim() != "0")) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // One write, so that ranks failing together do not interleave their messages.
            let line = match &rank {
                Some(rank) => format!("error (rank {rank}): {e:#}\n"),
                None => format!("error: {e:#}\n"),
            };
            let _ = std::io::stderr().write_all(line.as_bytes());
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli, silent_rank: bool) -> Result<()> {
    kernels::route::check_env().map_err(anyhow::Error::msg)?;
    kernels::simd::check_env().map_err(anyhow::Error::msg)?;
    let (verbose, quiet) = (cli.verbose, cli.quiet || silent_rank);
    let ranked = std::env::var_os(host::distributed::HOSTFILE_ENV).is_some();
    let sharded = matches!(
        &cli.command,
        Command::Run(_) | Command::Serve(_) | Command::Bench(BenchArgs { collectives: true, .. })
    );
    if ranked && !sharded {
        bail!("a rank of `host launch` runs `run`, `serve` or `bench --collectives` (this command does not shard over ranks)");
    }
    match cli.command {
        Command::Launch { ranks, hostfile, command } => {
            if !matches!(command.first().and_then(|c| c.to_str()), Some("run" | "serve" | "bench")) {
                bail!("host launch runs `run …`, `serve …` or `bench --collectives`");
            }
            if let Some(status) = host::launch::launch(&host::launch::LaunchOptions { ranks, hostfile, args: command })?
            {
                std::process::exit(status);
            }
        }
        Command::Run(args) => run_manifest(args, quiet)?,
        Command::Bench(args) => bench(args, quiet)?,
        Command::Serve(args) => serve(args, quiet, silent_rank)?,
        Command::Doctor { json, dir } => {
            let report = doctor::Report::collect(plugins_dir::resolve(dir.plugins_dir).path)?;
            print_report(json, &report, || report.human())?;
        }
        Command::Completions { shell } => {
            // Written whole, so that a closed pipe is an error line rather than a panic.
            let mut script = Vec::new();
            clap_complete::generate(shell, &mut Cli::command(), "host", &mut script);
            std::io::stdout().write_all(&script)?;
        }
        Command::NewDrafter { name, dir, trainable } => {
            let dir = dir.unwrap_or_else(|| PathBuf::from(&name));
            let host = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("host"));
            host::new_drafter::write(&name, &dir, &host, trainable)?;
            if !quiet {
                eprintln!("wrote the drafter `{name}` in {}: its README.md has the commands to build, check, run and bench it", dir.display());
            }
        }
        Command::CheckModel { dir, json } => {
            let report = host::check_model::check(&dir)?;
            print_report(json, &report, || report.text())?;
            if !report.ok() {
                bail!("{}: the checkpoint is broken (see above)", dir.display());
            }
        }
        Command::Plugins { command: PluginsCommand::List { json, dir } } => {
            let (dir, registry) = scan(dir)?;
            if json {
                let entries: Vec<_> = registry.entries.iter().map(|e| report::entry_json(e, verbose)).collect();
                println!(
                    "{}",
                    serde_json::to_string_pretty(&serde_json::json!({ "plugins_dir": dir, "plugins": entries }))?
                );
            } else {
                println!("plugins in {}", dir.display());
                if registry.entries.is_empty() {
                    println!("  (no libraries)");
                }
                for entry in &registry.entries {
                    println!("  {}", report::entry_line(entry, verbose));
                }
            }
        }
        Command::Plugins { command: PluginsCommand::Check { library, model, artifact, options, prompts, json } } => {
            let report = check_plugin(&library, model, artifact.as_deref(), &options, prompts)?;
            print_report(json, &report, || report.text())?;
            if !report.passed() {
                bail!("{} did not pass every check", library.display());
            }
        }
        Command::Plugins { command: PluginsCommand::Inspect { plugin, json, dir } } => {
            let path = PathBuf::from(&plugin);
            let outcome = if path.is_file() {
                load::load(&path, None).map_err(|e| (path.clone(), e))
            } else {
                let (dir, registry) = scan(dir)?;
                match registry.find(&plugin) {
                    Some(p) => Ok(p.clone()),
                    None => bail!("no plugin of kind `{plugin}` in {} (and no such file)", dir.display()),
                }
            };
            match (outcome, json) {
                (Ok(p), true) => println!("{}", serde_json::to_string_pretty(&report::plugin_json(&p))?),
                (Ok(p), false) => print!("{}", report::plugin_text(&p)),
                (Err((path, e)), true) => {
                    println!("{}", serde_json::to_string_pretty(&report::refused_json(&path, &e, verbose))?);
                    bail!("{}: {e}", path.display())
                }
                (Err((path, e)), false) => {
                    if let (true, Some(detail)) = (verbose, e.detail()) {
                        eprintln!("{detail}");
                    }
                    bail!("{}: {e}", path.display())
                }
            }
        }
        Command::Manifest { command: ManifestCommand::Check { file, dir } } => {
            let manifest = Manifest::load(&file)?;
            println!("target    {}", manifest.target_model.display());
            match load_drafter(&manifest, &plugins_dir::resolve(dir.plugins_dir))? {
                None => println!("drafter   none (plain decoding)"),
                Some((drafter, config)) => {
                    let spec = manifest.drafter.as_ref().expect("a drafter was loaded");
                    let tokens = host::speculative::describe_draft_tokens(config.auto, config.draft_tokens);
                    println!("drafter   {}, {tokens} draft tokens, verify {:?}", spec.kind, config.verify);
                    for warning in host::run::depth_warnings(&drafter.info, &config) {
                        println!("warning   {warning}");
                    }
                    println!("artifact  {} ({} bytes of weights)", drafter.info.id, drafter.info.weights_bytes);
                    let max = drafter.info.capabilities.max_draft_tokens;
                    println!("max draft {}", if max == 0 { "no limit".to_owned() } else { format!("{max} tokens") });
                }
            }
            println!("ok: {}", file.display());
        }
    }
    Ok(())
}

/// `host plugins check`: the target and prompts set up, then every check of `plugin::check`.
fn check_plugin(
    library: &Path,
    model: Option<PathBuf>,
    artifact: Option<&Path>,
    options: &str,
    prompts: Option<PathBuf>,
) -> Result<host::plugin::check::Report> {
    let model_dir = model.unwrap_or_else(host::checkout::demo_target);
    let target = std::rc::Rc::new(host::model::load(&model_dir)?);
    let tokenizer = host::tokenizer::Tokenizer::load(&model_dir)?;
    let prompts_file = prompts.unwrap_or_else(|| model_dir.join("bench-prompts.jsonl"));
    let text = std::fs::read_to_string(&prompts_file)
        .with_context(|| format!("reading prompts from {} (give --prompts FILE)", prompts_file.display()))?;
    let mut prompts = Vec::new();
    for (n, line) in text.lines().filter(|l| !l.trim().is_empty()).take(3).enumerate() {
        let value: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a JSON object", prompts_file.display(), n + 1))?;
        let prompt = value["prompt"]
            .as_str()
            .with_context(|| format!("{}:{}: no string `prompt`", prompts_file.display(), n + 1))?;
        prompts.push(tokenizer.encode(prompt)?);
    }
    if prompts.is_empty() {
        bail!("{} holds no prompt", prompts_file.display());
    }
    // Past the sliding window, where the target's cache wraps.
    let max_tokens = target.config.sliding_window + 32;
    let setup =
        host::plugin::check::Setup { library, model: &target, artifact, options, prompts: &prompts, max_tokens };
    Ok(host::plugin::check::check(&setup))
}

fn scan(dir: PluginsDir) -> Result<(PathBuf, Registry)> {
    let dir = plugins_dir::resolve(dir.plugins_dir).path;
    let registry = Registry::scan(&dir).with_context(|| format!("reading plugins directory {}", dir.display()))?;
    Ok((dir, registry))
}

fn serve(args: ServeArgs, quiet: bool, silent_rank: bool) -> Result<()> {
    let source = Source::from(args.source);
    let server = source.load()?.server;
    let options = host::serve::ServeOptions {
        run: RunOptions {
            source,
            overrides: Overrides { draft_tokens: args.draft_tokens, ..Overrides::default() },
            plugins_dir: plugins_dir::resolve(args.dir.plugins_dir),
            compare_plain: false,
        },
        host: args.host.or(server.host).unwrap_or_else(|| "127.0.0.1".into()),
        port: args.port.or(server.port).unwrap_or(8080),
        api_key: args.api_key.or(server.api_key),
        max_batch: args.max_batch.or(server.max_batch).unwrap_or(8) as usize,
        max_queue: args.max_queue.or(server.max_queue).unwrap_or(64) as usize,
        prefix_cache_mb: args.prefix_cache_mb.or(server.prefix_cache_mb).unwrap_or(256) as usize,
    };
    if silent_rank {
        host::serve::follow(options)?;
        return Ok(());
    }
    host::serve::serve(
        options,
        |address| eprintln!("listening on http://{address}"),
        move |warning| {
            if !quiet {
                eprintln!("warning: {warning}");
            }
        },
    )?;
    Ok(())
}

/// One `ID=BIAS` of `--logit-bias`.
fn parse_logit_bias(pair: &str) -> Result<(u32, f32), String> {
    let (id, bias) = pair.split_once('=').ok_or_else(|| format!("`{pair}` is not ID=BIAS"))?;
    let id = id.trim().parse().map_err(|_| format!("`{id}` is not a token id"))?;
    let bias = bias.trim().parse().map_err(|_| format!("`{bias}` is not a number"))?;
    Ok((id, bias))
}

fn run_manifest(args: RunArgs, quiet: bool) -> Result<()> {
    let options = RunOptions {
        source: args.source.into(),
        overrides: Overrides {
            prompt: args.prompt,
            prompt_ids: args.prompt_ids,
            chat: args.chat,
            max_tokens: args.max_tokens,
            temperature: args.temperature,
            top_p: args.top_p,
            top_k: args.top_k,
            min_p: args.min_p,
            seed: args.seed,
            draft_tokens: args.draft_tokens,
            frequency_penalty: args.frequency_penalty,
            presence_penalty: args.presence_penalty,
            repetition_penalty: args.repetition_penalty,
            repetition_context_size: args.repetition_context_size,
            logit_bias: args.logit_bias,
            logprobs: args.logprobs,
        },
        plugins_dir: plugins_dir::resolve(args.dir.plugins_dir),
        compare_plain: args.compare_plain,
    };
    host::interrupt::install();
    if let Some(file) = &args.prompts_file {
        let jsonl = std::fs::read_to_string(file).with_context(|| format!("reading {}", file.display()))?;
        if jsonl.lines().all(|line| line.trim().is_empty()) {
            bail!("{}: no request in it (one JSON object per line)", file.display());
        }
        // The output is opened before any work, so that a path that cannot be written costs
        // nothing; each result is written (and flushed) as soon as it is in order.
        let mut sink: Box<dyn Write> = match &args.output {
            Some(path) => Box::new(
                std::fs::File::create(path).with_context(|| format!("--output {}: cannot write it", path.display()))?,
            ),
            None => Box::new(std::io::stdout().lock()),
        };
        let bar =
            (std::io::stderr().is_terminal() && !quiet).then(|| spinner(&format!("generating {}", file.display())));
        let counts = host::batch::run_batch(
            &options,
            &jsonl,
            |warning| {
                if !quiet {
                    eprintln!("warning: {warning}");
                }
            },
            host::interrupt::requested,
            |result| {
                let line = serde_json::to_string(&result).expect("results serialize");
                writeln!(sink, "{line}").and_then(|()| sink.flush())
            },
        );
        bar.inspect(ProgressBar::finish_and_clear);
        let counts = counts?;
        if !quiet {
            eprintln!("{} requests, {} failed", counts.results, counts.failed);
        }
        exit_if_interrupted();
        return Ok(());
    }
    // Progress (loading, a long prefill) only on a terminal: pipes and --json stay clean.
    let mut bar = (std::io::stderr().is_terminal() && !quiet).then(|| spinner("loading the target and drafter"));
    let mut stdout = std::io::stdout().lock();
    let mut stdout_closed = false;
    let output = host::run::run(&options, |event| {
        match event {
            RunEvent::Prefill { done, total } => {
                if let Some(bar) = &bar {
                    if total > host::generate::PREFILL_CHUNK && bar.length().is_none() {
                        bar.set_style(
                            ProgressStyle::with_template("prefill {bar:30} {pos}/{len} tokens")
                                .expect("a valid template"),
                        );
                        bar.set_length(total as u64);
                    }
                    bar.set_position(done as u64);
                }
                if done == total {
                    bar.take().inspect(ProgressBar::finish_and_clear);
                }
            }
            RunEvent::Text(piece) => {
                bar.take().inspect(ProgressBar::finish_and_clear);
                if !args.json {
                    // A closed stdout (`host run … | head`) stops generation at the next token.
                    stdout_closed |= write!(stdout, "{piece}").and_then(|()| stdout.flush()).is_err();
                }
            }
            RunEvent::Warning(warning) => {
                bar.take().inspect(ProgressBar::finish_and_clear);
                if !quiet {
                    eprintln!("warning: {warning}");
                }
            }
        }
        // With --json nothing is written until the end, so a reader that left is asked after.
        stdout_closed |= args.json && kernels::os::files::stdout_reader_gone();
        if stdout_closed || host::interrupt::requested() {
            Flow::Stop
        } else {
            Flow::Continue
        }
    });
    let output = match output {
        // What was produced before the failure is printed as JSON too, with the error.
        Err(host::run::RunError::Partway(partway)) if args.json => {
            let host::run::Partway { error, tokens, text } = *partway;
            let failed =
                serde_json::json!({"tokens": tokens, "text": text, "stop": "error", "error": error.to_string()});
            writeln!(stdout, "{failed}")?;
            return Err(error.into());
        }
        other => other?,
    };
    bar.take().inspect(ProgressBar::finish_and_clear);
    if args.json {
        writeln!(stdout, "{}", serde_json::to_string(&output)?)?;
    } else {
        // Text ends with a newline even when interrupted; a closed stdout takes none.
        let _ = writeln!(stdout);
        if args.stats {
            eprint!("{}", output.stats_table());
        } else if !quiet {
            eprint!("{}", output.summary());
        }
    }
    let _ = stdout.flush();
    exit_if_interrupted();
    Ok(())
}

/// Ends the process with the conventional status of the signal that asked it to stop (130 after
/// Ctrl-C, 143 after SIGTERM), once what was produced is out.
fn exit_if_interrupted() {
    if let Some(status) = host::interrupt::exit_status() {
        std::process::exit(status);
    }
}

/// A spinner on stderr with `message`, ticking on its own.
fn spinner(message: &str) -> ProgressBar {
    let bar = ProgressBar::new_spinner().with_message(message.to_owned());
    bar.enable_steady_tick(std::time::Duration::from_millis(100));
    bar
}

fn bench(args: BenchArgs, quiet: bool) -> Result<()> {
    let bar = (std::io::stderr().is_terminal() && !quiet).then(|| spinner("benchmarking"));
    if args.collectives {
        let report = host::bench::collectives::collectives();
        bar.inspect(ProgressBar::finish_and_clear);
        let report = report?;
        return print_report(args.json, &report, || report.text());
    }
    if let (Some(ranks), Some(manifest)) = (args.ranks, &args.manifest) {
        // Each rank resolves the directory as this process would, the manifest's included.
        let plugins = args.dir.plugins_dir;
        let report = host::bench::ranks::ranks(manifest, plugins.as_deref(), ranks, args.pairs, args.max_tokens);
        bar.inspect(ProgressBar::finish_and_clear);
        let report = report?;
        return print_report(args.json, &report, || report.text());
    }
    if args.kernels {
        let report = host::bench::kernels::kernels();
        bar.inspect(ProgressBar::finish_and_clear);
        let report = report?;
        return print_report(args.json, &report, || report.text());
    }
    if let Some(manifests) = args.sweep {
        let options = host::bench::sweep::SweepOptions {
            manifests,
            prompts_file: args.prompts_file.expect("clap requires it with --sweep"),
            draft_tokens: args.draft_tokens,
            sampled_draft_tokens: args.sampled_draft_tokens,
            max_tokens: args.max_tokens,
            temperature: args.temperature,
            top_p: args.top_p,
            equal_width_trees: args.equal_width_trees,
            plugins_dir: plugins_dir::resolve(args.dir.plugins_dir),
        };
        let report = host::bench::sweep::sweep(&options);
        bar.inspect(ProgressBar::finish_and_clear);
        let report = report?;
        if let Some(path) = &args.plot {
            host::bench::plot::speedups(&report, path)?;
        }
        return print_report(args.json, &report, || report.text());
    }
    if args.draft_tokens.len() > 1 {
        anyhow::bail!("--draft-tokens: one length, unless with --sweep");
    }
    let options = BenchOptions {
        manifest: args.manifest.expect("clap requires it without --kernels or --sweep"),
        pairs: args.pairs,
        max_tokens: args.max_tokens,
        mlx_lm_python: args.mlx_lm_python,
        no_mlx_lm: args.no_mlx_lm,
        llama_cpp: args.llama_bench.zip(args.gguf),
        llama_bench_args: args
            .llama_bench_args
            .map(|a| a.split_whitespace().map(str::to_owned).collect())
            .unwrap_or_default(),
        prompt_tokens: args.prompt_tokens.map(|n| n as usize),
        plugins_dir: plugins_dir::resolve(args.dir.plugins_dir),
        serving: args.serving,
        requests: args.requests,
        draft_tokens: args.draft_tokens.first().copied(),
    };
    let report = host::bench::bench(&options);
    bar.inspect(ProgressBar::finish_and_clear);
    let report = report?;
    print_report(args.json, &report, || report.text())
}

/// A report as pretty JSON, or as its text.
fn print_report(json: bool, report: &impl serde::Serialize, text: impl FnOnce() -> String) -> Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(report)?);
    } else {
        print!("{}", text());
    }
    Ok(())
}

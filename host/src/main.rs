use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use host::manifest::Manifest;
use host::plugin::{load, report, select, Drafter, Registry};
use host::{doctor, plugins_dir};

/// Lossless speculative decoding of Gemma 4 with drafters loaded as plugins.
#[derive(Parser)]
#[command(name = "host", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Args)]
struct PluginsDir {
    /// Where drafter plugins are looked for (default: $HOST_PLUGINS_DIR, else the directory
    /// of this executable).
    #[arg(long, value_name = "DIR", global = true)]
    plugins_dir: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Command {
    /// Show the MLX runtime, BLAS, device and plugins directory this process uses.
    Doctor {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        dir: PluginsDir,
    },
    /// List or inspect drafter plugins.
    Plugins {
        #[command(subcommand)]
        command: PluginsCommand,
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
        /// Show the full report behind a refusal where there is one.
        #[arg(long)]
        verbose: bool,
        #[command(flatten)]
        dir: PluginsDir,
    },
    /// One plugin's descriptor, by kind or by library path.
    Inspect {
        /// A plugin kind (e.g. `ngram`) or the path of a library.
        plugin: String,
        #[arg(long)]
        json: bool,
        #[arg(long)]
        verbose: bool,
        #[command(flatten)]
        dir: PluginsDir,
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

fn main() -> ExitCode {
    host::runtime::init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Doctor { json, dir } => {
            let report = doctor::Report::collect(plugins_dir::resolve(dir.plugins_dir))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.human());
            }
        }
        Command::Plugins { command: PluginsCommand::List { json, verbose, dir } } => {
            let dir = plugins_dir::resolve(dir.plugins_dir);
            let registry = Registry::scan(&dir).with_context(|| format!("reading plugins directory {}", dir.display()))?;
            if json {
                let entries: Vec<_> = registry.entries.iter().map(|e| report::entry_json(e, verbose)).collect();
                println!("{}", serde_json::to_string_pretty(&serde_json::json!({ "plugins_dir": dir, "plugins": entries }))?);
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
        Command::Plugins { command: PluginsCommand::Inspect { plugin, json, verbose, dir } } => {
            let path = PathBuf::from(&plugin);
            let outcome = if path.is_file() {
                load::load(&path, None).map_err(|e| (path.clone(), e))
            } else {
                let dir = plugins_dir::resolve(dir.plugins_dir);
                let registry = Registry::scan(&dir).with_context(|| format!("reading plugins directory {}", dir.display()))?;
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
            match &manifest.drafter {
                None => println!("drafter   none (plain decoding)"),
                Some(spec) => {
                    let dir = plugins_dir::resolve(dir.plugins_dir);
                    let plugin = select(&dir, &spec.kind, spec.sha256.as_deref())?;
                    manifest.check_drafter(&plugin.descriptor)?;
                    let drafter = Drafter::load(&plugin, spec.artifact.as_deref(), &spec.options_toml())?;
                    println!("drafter   {} {} ({}), {} draft tokens", spec.kind, plugin.descriptor.version, plugin.path.display(), spec.draft_tokens);
                    println!("artifact  {} ({} bytes of weights)", drafter.info.id, drafter.info.weights_bytes);
                }
            }
            println!("ok: {}", file.display());
        }
    }
    Ok(())
}

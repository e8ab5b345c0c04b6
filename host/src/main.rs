use std::path::PathBuf;

use anyhow::Result;
use clap::{Parser, Subcommand};

use host::{doctor, plugins_dir};

/// Lossless speculative decoding of Gemma 4 with drafters loaded as plugins.
#[derive(Parser)]
#[command(name = "host", version)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Show the MLX runtime, BLAS, device and plugins directory this process uses.
    Doctor {
        /// Print one JSON object instead of text.
        #[arg(long)]
        json: bool,
        /// Where drafter plugins are looked for.
        #[arg(long, value_name = "DIR")]
        plugins_dir: Option<PathBuf>,
    },
}

fn main() -> Result<()> {
    match Cli::parse().command {
        Command::Doctor { json, plugins_dir } => {
            let report = doctor::Report::collect(plugins_dir::resolve(plugins_dir))?;
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.human());
            }
        }
    }
    Ok(())
}

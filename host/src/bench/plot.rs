//! The sweep's figure: speed-up over plain decoding against draft length, one panel per mode
//! (greedy, sampled with `match`, sampled with `rejection`), one line per drafter, with each
//! point's range over the prompts as a bar.

use std::path::{Path, PathBuf};

use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use super::sweep::{SweepReport, SweepRow, TREES};

/// Debian's DejaVu Sans (`fonts-dejavu-core`, which scripts/setup.sh installs): plotters draws
/// text with a font it is given, and reading the system's keeps a font file out of the binary.
const FONT: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("--plot: reading the font {FONT} (apt-get install fonts-dejavu-core): {0}")]
    Font(String),
    #[error("--plot {path}: {reason}")]
    Draw { path: PathBuf, reason: String },
}

pub fn speedups(report: &SweepReport, path: &Path) -> Result<(), PlotError> {
    let font = std::fs::read(FONT).map_err(|e| PlotError::Font(e.to_string()))?;
    register_font("sans-serif", FontStyle::Normal, Box::leak(font.into_boxed_slice()))
        .map_err(|_| PlotError::Font("not a usable TrueType font".into()))?;
    draw(report, path).map_err(|e| PlotError::Draw { path: path.to_owned(), reason: e.to_string() })
}

fn draw(report: &SweepReport, path: &Path) -> Result<(), Box<dyn std::error::Error>> {
    let mut modes: Vec<&str> = Vec::new();
    let mut drafters: Vec<&str> = Vec::new();
    for r in &report.rows {
        if !modes.contains(&r.mode.as_str()) {
            modes.push(&r.mode);
        }
        if !drafters.contains(&r.drafter.as_str()) {
            drafters.push(&r.drafter);
        }
    }
    let chains: Vec<&str> = drafters.iter().filter(|d| !d.ends_with(TREES)).copied().collect();
    let max_x = report.rows.iter().filter(|r| !r.auto_draft_tokens).map(|r| r.draft_tokens).max().unwrap_or(1) as f64;
    let max_y = report.rows.iter().map(|r| r.speedup_max).fold(1.5_f64, f64::max) * 1.05;
    let root = BitMapBackend::new(path, (560 * modes.len() as u32, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    for (panel, mode) in root.split_evenly((1, modes.len())).iter().zip(&modes) {
        let title = match *mode {
            "greedy" => "greedy".to_owned(),
            m => format!("temperature {} (top-p {}), {m}", report.temperature.unwrap_or(0.0), report.top_p),
        };
        let mut chart = ChartBuilder::on(panel)
            .caption(title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(50)
            .build_cartesian_2d(0.5..max_x + 0.5, 0.0..max_y)?;
        chart
            .configure_mesh()
            .light_line_style(WHITE)
            .x_labels(max_x as usize * 2 + 1)
            .x_label_formatter(&|x| if x.fract() == 0.0 { format!("{x:.0}") } else { String::new() })
            .x_desc("draft tokens per round (γ)")
            .y_desc("speed-up over plain decoding")
            .draw()?;
        chart.draw_series(LineSeries::new([(0.5, 1.0), (max_x + 0.5, 1.0)], BLACK.mix(0.4)))?;
        for drafter in &drafters {
            // A drafter's trees (`--equal-width-trees`) take its chain's colour, dashed.
            let chain = drafter.strip_suffix(TREES).unwrap_or(drafter);
            let tree = chain != *drafter;
            let color = Palette99::pick(chains.iter().position(|&c| c == chain).unwrap_or(0)).to_rgba();
            let (auto, rows): (Vec<&SweepRow>, Vec<&SweepRow>) = report
                .rows
                .iter()
                .filter(|r| r.mode == *mode && r.drafter == *drafter)
                .partition(|r| r.auto_draft_tokens);
            // `"auto"` chooses its length each round: a dashed level across every length.
            for r in auto {
                let level = [(0.5, r.speedup_median), (max_x + 0.5, r.speedup_median)];
                chart.draw_series(DashedLineSeries::new(level, 6, 4, color.stroke_width(1)))?;
            }
            if rows.is_empty() {
                continue;
            }
            // Trees' points sit a little right of their chain's, so that both ranges show.
            let x = |r: &SweepRow| r.draft_tokens as f64 + if tree { 0.12 } else { 0.0 };
            let points: Vec<(f64, f64)> = rows.iter().map(|r| (x(r), r.speedup_median)).collect();
            let line = if tree {
                chart.draw_series(DashedLineSeries::new(points.clone(), 8, 5, color.stroke_width(2)))?
            } else {
                chart.draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))?
            };
            line.label(*drafter).legend(move |(x, y)| {
                let dash = if tree { 8 } else { 18 };
                PathElement::new([(x, y), (x + dash, y)], color.stroke_width(2))
            });
            chart.draw_series(points.iter().map(|&p| Circle::new(p, 4, color.filled())))?;
            chart.draw_series(rows.iter().map(|r| {
                PathElement::new([(x(r), r.speedup_min), (x(r), r.speedup_max)], color.mix(0.5).stroke_width(2))
            }))?;
        }
        chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).draw()?;
    }
    root.present()?;
    Ok(())
}

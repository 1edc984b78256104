//! `synerfuse timeline`: a training run's measured step, rank by rank (the spans its
//! `--log-json` records carry), drawn under the planner's prediction of the same step.

use crate::files::write_atomically;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use synerfuse_plan::timeline::{RankTimeline, Span, SpanKind, Timeline};

#[derive(clap::Args)]
pub struct TimelineArgs {
    /// A training run's --log-json file
    log: PathBuf,
    /// Draw here (SVG)
    #[arg(long)]
    output: PathBuf,
    /// The iteration to draw (default: the last whose record has every rank's spans:
    /// those whose log line was printed, every --log-interval)
    #[arg(long)]
    iteration: Option<u64>,
    /// The prediction to draw above it: `synerfuse plan --timeline FILE.json`
    #[arg(long)]
    predicted: Option<PathBuf>,
}

pub fn run(args: TimelineArgs) -> Result<()> {
    let measured = measured_step(&args.log, args.iteration)?;
    let mut drawn = Vec::new();
    if let Some(path) = &args.predicted {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        let predicted: Timeline = serde_json::from_str(&text).with_context(|| {
            format!(
                "{}: not a timeline (write one with synerfuse plan --timeline FILE.json)",
                path.display()
            )
        })?;
        let (p, m) = (predicted.step_s(), measured.step_s());
        println!(
            "predicted step {p:.4} s, measured {m:.4} s ({:+.1}%)",
            (p / m - 1.0) * 100.0
        );
        drawn.push(predicted);
    }
    for (rank, row) in measured.ranks.iter().enumerate() {
        let busy = row.seconds(SpanKind::Forward) + row.seconds(SpanKind::Backward);
        println!(
            "rank {rank}: forward+backward {busy:.4} s, waiting {:.4} s, sends {:.4} s, DP reduction {:.4} s, optimizer {:.4} s, parameter gather {:.4} s",
            row.seconds(SpanKind::Wait),
            row.seconds(SpanKind::Send),
            row.seconds(SpanKind::Reduce),
            row.seconds(SpanKind::Optimizer),
            row.seconds(SpanKind::Gather)
        );
    }
    drawn.push(measured);
    write_atomically(&args.output, &Timeline::svg(&drawn))?;
    println!("wrote {}", args.output.display());
    Ok(())
}

/// The step of `iteration` (or the last with spans) as every rank measured it.
fn measured_step(log: &Path, iteration: Option<u64>) -> Result<Timeline> {
    let text =
        std::fs::read_to_string(log).with_context(|| format!("reading {}", log.display()))?;
    let mut found = None;
    for (number, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not a JSON record", log.display(), number + 1))?;
        let Some(at) = record["iteration"].as_u64() else {
            continue;
        };
        let Some(ranks) = record["ranks"].as_array() else {
            continue;
        };
        if iteration.is_some_and(|i| i != at) || ranks.iter().any(|r| r["spans"].is_null()) {
            continue;
        }
        let rows = ranks
            .iter()
            .enumerate()
            .map(|(rank, r)| {
                let spans: Vec<Span> =
                    serde_json::from_value(r["spans"].clone()).with_context(|| {
                        format!("{}:{}: rank {rank}'s spans", log.display(), number + 1)
                    })?;
                Ok(RankTimeline {
                    label: format!("rank {rank}"),
                    spans,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        found = Some((at, rows));
    }
    let Some((at, ranks)) = found else {
        match iteration {
            Some(i) => bail!(
                "{}: no record of iteration {i} with every rank's spans (they are kept on the iterations whose log line is printed, every --log-interval, and the last)",
                log.display()
            ),
            None => bail!(
                "{}: no record with every rank's spans (train with --log-json; a record carries them on the iterations whose log line is printed)",
                log.display()
            ),
        }
    };
    Ok(Timeline {
        title: format!("measured: iteration {at}"),
        ranks,
    })
}

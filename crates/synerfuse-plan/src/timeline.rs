//! A step drawn per rank: what each rank does when (forward, backward, waiting for a
//! message, the data-parallel reduction, the optimizer), simulated by the planner or
//! measured by the trainer, as an SVG a user opens in a browser to see where the
//! bubble and the waiting are.

use std::fmt::Write;

/// What a rank does during a span.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SpanKind {
    /// A forward pass of a micro-batch.
    Forward,
    /// A backward pass of a micro-batch.
    Backward,
    /// Sending (the sender's share of a transfer).
    Send,
    /// Blocked until a message arrives.
    Wait,
    /// Waiting for the data-parallel gradient reduction after the pipeline (what
    /// computation did not hide of it).
    Reduce,
    /// The optimizer step.
    Optimizer,
    /// Waiting for the distributed optimizer's all-gather of the updated parameters
    /// (what computation did not hide of it).
    Gather,
    /// A bucket of the gradient reduction in flight, from its start to when the rank saw
    /// it complete: it overlaps the computation that hides it, so it is drawn as a
    /// stripe under the rank's row.
    Bucket,
}

impl SpanKind {
    /// Every kind, in legend order.
    pub const ALL: [SpanKind; 8] = [
        SpanKind::Forward,
        SpanKind::Backward,
        SpanKind::Send,
        SpanKind::Wait,
        SpanKind::Reduce,
        SpanKind::Optimizer,
        SpanKind::Gather,
        SpanKind::Bucket,
    ];

    fn colour(self) -> &'static str {
        match self {
            SpanKind::Forward => "#4e79a7",
            SpanKind::Backward => "#f28e2b",
            SpanKind::Send => "#76b7b2",
            SpanKind::Wait => "#e0e0e0",
            SpanKind::Reduce => "#59a14f",
            SpanKind::Optimizer => "#b07aa1",
            SpanKind::Gather => "#edc948",
            SpanKind::Bucket => "#1b5e20",
        }
    }

    fn label(self) -> &'static str {
        match self {
            SpanKind::Forward => "forward",
            SpanKind::Backward => "backward",
            SpanKind::Send => "send",
            SpanKind::Wait => "waiting",
            SpanKind::Reduce => "DP reduction wait",
            SpanKind::Optimizer => "optimizer",
            SpanKind::Gather => "parameter gather wait",
            SpanKind::Bucket => "bucket in flight",
        }
    }
}

/// One stretch of a rank's step.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Span {
    /// What the rank does.
    pub kind: SpanKind,
    /// Start, seconds from the step's start.
    pub start_s: f64,
    /// End, seconds from the step's start.
    pub end_s: f64,
    /// The micro-batch, for passes and sends.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro_batch: Option<usize>,
}

/// One rank's row.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct RankTimeline {
    /// Who the rank is (`rank 3: replica 0, stage 1, a100-80g`).
    pub label: String,
    /// Its spans, in time order.
    pub spans: Vec<Span>,
}

impl RankTimeline {
    /// Seconds spent in spans of `kind`.
    pub fn seconds(&self, kind: SpanKind) -> f64 {
        (self.spans.iter())
            .filter(|s| s.kind == kind)
            .map(|s| s.end_s - s.start_s)
            .sum()
    }

    /// When its last span ends.
    pub fn end_s(&self) -> f64 {
        self.spans.iter().map(|s| s.end_s).fold(0.0, f64::max)
    }
}

/// A step of every rank.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Timeline {
    /// What it shows (`predicted: pp 2 × dp 2, ...` or `measured: iteration 7`).
    pub title: String,
    /// One row per rank, in rank order.
    pub ranks: Vec<RankTimeline>,
}

impl Timeline {
    /// When the last rank finishes.
    pub fn step_s(&self) -> f64 {
        self.ranks
            .iter()
            .map(RankTimeline::end_s)
            .fold(0.0, f64::max)
    }

    /// The timelines drawn one above the other on one time scale (a prediction and a
    /// measurement side by side), as a standalone SVG document.
    pub fn svg(timelines: &[Timeline]) -> String {
        const LEFT: f64 = 230.0;
        const WIDTH: f64 = 900.0;
        const ROW: f64 = 18.0;
        const TITLE: f64 = 26.0;
        let scale_s = timelines.iter().map(Timeline::step_s).fold(1e-12, f64::max);
        let x = |t: f64| LEFT + WIDTH * t / scale_s;
        let height: f64 = (timelines.iter())
            .map(|t| TITLE + ROW * t.ranks.len() as f64 + 10.0)
            .sum::<f64>()
            + 60.0;
        let mut out = String::new();
        let _ = writeln!(
            out,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{height}" font-family="sans-serif" font-size="11">"#,
            w = LEFT + WIDTH + 20.0
        );
        let _ = writeln!(out, r#"<rect width="100%" height="100%" fill="white"/>"#);
        let mut y = 0.0;
        for timeline in timelines {
            let _ = writeln!(
                out,
                r#"<text x="4" y="{}" font-size="13" font-weight="bold">{} (step {:.4} s)</text>"#,
                y + 17.0,
                escape(&timeline.title),
                timeline.step_s()
            );
            y += TITLE;
            for rank in &timeline.ranks {
                let _ = writeln!(
                    out,
                    r#"<text x="4" y="{}">{}</text>"#,
                    y + 13.0,
                    escape(&rank.label)
                );
                for span in &rank.spans {
                    let width = (x(span.end_s) - x(span.start_s)).max(0.0);
                    let micro_batch = span.micro_batch.map_or(String::new(), |m| format!(" {m}"));
                    // A bucket overlaps the passes: a stripe along the row's foot.
                    let (top, height) = match span.kind {
                        SpanKind::Bucket => (y + ROW - 7.0, 4.0),
                        _ => (y, ROW - 3.0),
                    };
                    let _ = writeln!(
                        out,
                        r#"<rect x="{:.2}" y="{top}" width="{width:.2}" height="{height}" fill="{}"><title>{}{micro_batch}: {:.6}–{:.6} s</title></rect>"#,
                        x(span.start_s),
                        span.kind.colour(),
                        span.kind.label(),
                        span.start_s,
                        span.end_s
                    );
                }
                y += ROW;
            }
            y += 10.0;
        }
        let _ = writeln!(
            out,
            r#"<line x1="{LEFT}" y1="{y}" x2="{}" y2="{y}" stroke="black"/><text x="{LEFT}" y="{}">0 s</text><text x="{}" y="{}" text-anchor="end">{scale_s:.4} s</text>"#,
            LEFT + WIDTH,
            y + 14.0,
            LEFT + WIDTH,
            y + 14.0
        );
        for (k, kind) in SpanKind::ALL.iter().enumerate() {
            let lx = LEFT + 120.0 * k as f64;
            let _ = writeln!(
                out,
                r#"<rect x="{lx}" y="{}" width="12" height="12" fill="{}"/><text x="{}" y="{}">{}</text>"#,
                y + 28.0,
                kind.colour(),
                lx + 16.0,
                y + 38.0,
                kind.label()
            );
        }
        out.push_str("</svg>\n");
        out
    }
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_draws_every_span_on_one_scale() {
        let span = |kind, start_s, end_s| Span {
            kind,
            start_s,
            end_s,
            micro_batch: None,
        };
        let timeline = Timeline {
            title: "a <test>".into(),
            ranks: vec![
                RankTimeline {
                    label: "rank 0".into(),
                    spans: vec![
                        span(SpanKind::Forward, 0.0, 1.0),
                        span(SpanKind::Backward, 1.0, 3.0),
                    ],
                },
                RankTimeline {
                    label: "rank 1".into(),
                    spans: vec![
                        span(SpanKind::Wait, 0.0, 1.0),
                        span(SpanKind::Reduce, 1.0, 4.0),
                    ],
                },
            ],
        };
        assert_eq!(timeline.step_s(), 4.0);
        assert_eq!(timeline.ranks[0].seconds(SpanKind::Backward), 2.0);
        let svg = Timeline::svg(&[timeline]);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert_eq!(svg.matches("<title>").count(), 4);
        assert!(svg.contains("a &lt;test&gt;"));
        // The reduction runs from 1 s to the right edge at 4 s: x = 230 + 900 · t / 4.
        assert!(svg.contains(r#"x="455.00" y="44" width="675.00""#), "{svg}");
    }
}

//! What an evaluation found, as the log line and the metrics record it.

/// Which split an evaluation reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum EvalSplit {
    /// The validation split.
    Validation,
    /// The test split.
    Test,
}

/// One evaluation's result.
#[derive(Debug, Clone, PartialEq)]
pub struct Evaluation {
    /// The split read.
    pub split: EvalSplit,
    /// Training iterations completed when it ran.
    pub iteration: u64,
    /// Whether it is one of the end-of-training evaluations.
    pub at_end: bool,
    /// Mean loss over the evaluated loss tokens.
    pub loss: f64,
    /// Samples evaluated.
    pub samples: u64,
}

impl Evaluation {
    /// Perplexity as Megatron reports it: `exp(min(20, loss))`.
    pub fn ppl(&self) -> f64 {
        self.loss.min(20.0).exp()
    }

    /// Megatron's name for the evaluation point: `iteration 200` during training,
    /// `iteration 400 on validation set` / `on test set` at its end.
    pub fn prefix(&self) -> String {
        match (self.at_end, self.split) {
            (false, _) => format!("iteration {}", self.iteration),
            (true, EvalSplit::Validation) => {
                format!("iteration {} on validation set", self.iteration)
            }
            (true, EvalSplit::Test) => format!("iteration {} on test set", self.iteration),
        }
    }

    /// Megatron's three lines: dashes, `validation loss at ... | lm loss value: ... |
    /// lm loss PPL: ... |`, dashes.
    pub fn log_lines(&self) -> String {
        let line = format!(
            " validation loss at {} | lm loss value: {} | lm loss PPL: {} | ",
            self.prefix(),
            crate::metrics::python_exp(self.loss),
            crate::metrics::python_exp(self.ppl()),
        );
        let dashes = "-".repeat(line.chars().count() + 1);
        format!("{dashes}\n{line}\n{dashes}")
    }
}

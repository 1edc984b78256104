//! AdamW's hyper-parameters, apart so that the kernels take them without the optimizer.

/// AdamW hyper-parameters (`--adam-beta1 --adam-beta2 --adam-eps --weight-decay`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWConfig {
    /// β1 (Megatron's default 0.9).
    pub beta1: f64,
    /// β2 (Megatron's default 0.999; LLaMA runs pass 0.95).
    pub beta2: f64,
    /// ε (default 1e-8).
    pub eps: f64,
    /// Decoupled weight decay (default 0.01).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

//! Training-step throughput of one LLaMA stage on this machine: forward, backward and
//! the trainer's own AdamW step (`synerfuse_train::optim::AdamW`) on random tokens, timed
//! after warm-up. Used by `cargo xtask bench model`.
//!
//! `step_throughput HIDDEN LAYERS HEADS KV_HEADS FFN VOCAB SEQ BATCH STEPS THREADS DEVICE DTYPE
//! [LOSS]` prints one JSON line, with the process's peak resident memory. `LOSS` is
//! `chunked` (the default, the trainer's 1F1B last stage: the output layer and the loss
//! run together, chunk by chunk, in the forward) or `whole` (the whole logits, the loss
//! computed in the backward).

use synerfuse_model::tch::{self, Kind, Tensor};
use synerfuse_model::{
    BackwardFrom, DeviceRequest, LlamaConfig, OpenGate, ResolveDevice, Stage, StageHead,
};
use synerfuse_train::optim::{AdamW, AdamWConfig};

fn main() {
    let a: Vec<String> = std::env::args().skip(1).collect();
    let chunked = match a.get(12).map(String::as_str) {
        None | Some("chunked") => true,
        Some("whole") => false,
        Some(_) => usage(),
    };
    if !(12..=13).contains(&a.len()) {
        usage();
    }
    let n = |i: usize| -> usize { a[i].parse().expect("a number") };
    let (hidden, layers, heads, kv, ffn, vocab, seq, batch, steps, threads) =
        (n(0), n(1), n(2), n(3), n(4), n(5), n(6), n(7), n(8), n(9));
    tch::set_num_threads(threads as i32);
    let device = a[10].parse::<DeviceRequest>().unwrap().resolve().unwrap();
    let kind = match a[11].as_str() {
        "bf16" => Kind::BFloat16,
        _ => Kind::Float,
    };
    let config = LlamaConfig {
        vocab_size: vocab,
        hidden_size: hidden,
        intermediate_size: ffn,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv,
        head_dim: hidden / heads,
        max_position_embeddings: seq,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        tie_word_embeddings: false,
        attention_bias: false,
        mlp_bias: false,
        init_std: 0.02,
        moe: None,
    };
    tch::manual_seed(0);
    let mut stage = Stage::new(&config, 0..layers, device).unwrap();
    stage.set_kind(kind);
    // The defaults are torch.optim.AdamW's (β 0.9, 0.999, ε 1e-8, decay 0.01), as the
    // reference uses them.
    let mut optimizer = AdamW::new(AdamWConfig::default(), stage.var_store().variables());
    let tokens = Tensor::randint(
        vocab as i64,
        [batch as i64, seq as i64 + 1],
        (Kind::Int64, device),
    );
    let (inputs, labels) = (
        tokens.narrow(1, 0, seq as i64),
        tokens.narrow(1, 1, seq as i64),
    );
    // The loss is computed once: inside the backward (which needs its graph), or with
    // the output layer in the forward.
    let last_loss = std::cell::Cell::new(0.0);
    let loss_of = |logits: &Tensor| {
        let (sum, count) = Stage::loss(logits, &labels, None);
        let loss = sum / count;
        last_loss.set(loss.double_value(&[]));
        loss
    };
    let head = match chunked {
        true => StageHead::WithLoss,
        false => StageHead::Logits,
    };
    // Seconds in the forward, the backward (with the loss) and the optimizer step.
    let phases = std::cell::Cell::new([0.0f64; 3]);
    let timed = |phase: usize, started: std::time::Instant| {
        if device.is_cuda() {
            tch::Cuda::synchronize(0);
        }
        let mut p = phases.get();
        p[phase] += started.elapsed().as_secs_f64();
        phases.set(p);
        std::time::Instant::now()
    };
    let step = |optimizer: &mut AdamW| -> f64 {
        let started = std::time::Instant::now();
        optimizer.zero_grad();
        let gated = stage.gated(&OpenGate).ending_with(head);
        let mut pass = gated.forward_train(&inputs, None, None).unwrap();
        let kept = chunked.then(|| {
            let (sum, count) = stage.attach_loss(&mut pass, &labels, None);
            last_loss.set((sum / &count).double_value(&[]));
            (pass.take_attached_loss().expect("a kept loss"), count)
        });
        let started = timed(0, started);
        match &kept {
            Some((attached, count)) => {
                let from_kept = |_: &Tensor| attached / count;
                stage.backward(pass, BackwardFrom::Loss(&from_kept))
            }
            None => stage.backward(pass, BackwardFrom::Loss(&loss_of)),
        }
        .unwrap();
        let started = timed(1, started);
        optimizer.step(1e-4).expect("AdamW step");
        timed(2, started);
        last_loss.get()
    };
    let warmup = 2;
    for _ in 0..warmup {
        step(&mut optimizer);
    }
    if device.is_cuda() {
        tch::Cuda::synchronize(0);
    }
    phases.set([0.0; 3]);
    let started = std::time::Instant::now();
    let mut loss = 0.0;
    for _ in 0..steps {
        loss = step(&mut optimizer);
    }
    if device.is_cuda() {
        tch::Cuda::synchronize(0);
    }
    let seconds = started.elapsed().as_secs_f64();
    let tokens_per_second = (steps * batch * seq) as f64 / seconds;
    let [forward, backward, optimizer] = phases.get().map(|s| s / steps as f64);
    println!(
        "{{\"tokens_per_second\": {tokens_per_second:.3}, \"seconds\": {seconds:.4}, \"steps\": {steps}, \"parameters\": {}, \"loss\": {loss:.5}, \"forward_s\": {forward:.5}, \"backward_s\": {backward:.5}, \"optimizer_s\": {optimizer:.5}, \"peak_rss_mb\": {:.1}}}",
        config.num_parameters(),
        peak_rss_mb()
    );
}

fn usage() -> ! {
    eprintln!("usage: step_throughput HIDDEN LAYERS HEADS KV_HEADS FFN VOCAB SEQ BATCH STEPS THREADS DEVICE DTYPE [chunked|whole]");
    std::process::exit(2);
}

/// The process's peak resident set (`getrusage`'s `ru_maxrss`, KiB on Linux), in MiB.
fn peak_rss_mb() -> f64 {
    let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
    // SAFETY: `usage` is a valid, writable rusage; getrusage only writes into it.
    let ok = unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } == 0;
    match ok {
        // SAFETY: getrusage succeeded, so it filled `usage` (zeroed before anyway).
        true => unsafe { usage.assume_init() }.ru_maxrss as f64 / 1024.0,
        false => f64::NAN,
    }
}

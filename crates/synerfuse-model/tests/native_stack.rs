//! libtorch through tch on this machine: tensor arithmetic, autograd and one optimizer
//! step on the CPU, and the same on a GPU when libtorch sees one.

use tch::nn::{self, Module, OptimizerConfig};
use tch::{Device, Kind, Tensor};

#[test]
fn matmul_matches_hand_computation() {
    let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0]).reshape([2, 3]);
    let b = Tensor::from_slice(&[7.0f32, 8.0, 9.0, 10.0, 11.0, 12.0]).reshape([3, 2]);
    let c = a.matmul(&b);
    assert_eq!(c.size(), vec![2, 2]);
    let got: Vec<f32> = Vec::try_from(c.flatten(0, -1)).unwrap();
    assert_eq!(got, vec![58.0, 64.0, 139.0, 154.0]);
}

#[test]
fn autograd_gives_the_analytic_gradient() {
    // f(w) = sum((x·w)^2) has gradient 2·xᵀ(x·w).
    let x = Tensor::from_slice(&[1.0f64, 2.0, 3.0, 4.0]).reshape([2, 2]);
    let w = Tensor::from_slice(&[0.5f64, -1.0])
        .reshape([2, 1])
        .set_requires_grad(true);
    let y = x.matmul(&w);
    y.square().sum(Kind::Double).backward();
    let expected = x.tr().matmul(&y.detach()) * 2.0;
    let diff = (w.grad() - expected).abs().max().double_value(&[]);
    assert!(diff < 1e-12, "gradient differs by {diff}");
}

/// One AdamW step on a linear layer: the step changes the weights by the amount Adam's
/// first step prescribes (lr · sign(g), since m̂/√v̂ = g/|g|) and lowers the loss.
fn adamw_step_lowers_loss(device: Device) {
    tch::manual_seed(7);
    let vs = nn::VarStore::new(device);
    let layer = nn::linear(vs.root(), 4, 1, Default::default());
    let x = Tensor::randn([64, 4], (Kind::Float, device));
    let target = x.matmul(
        &Tensor::from_slice(&[1.0f32, -2.0, 0.5, 3.0])
            .reshape([4, 1])
            .to(device),
    );
    let loss_of = |layer: &nn::Linear| (layer.forward(&x) - &target).square().mean(Kind::Float);

    let lr = 1e-2;
    let mut opt = nn::AdamW::default().wd(0.0).build(&vs, lr).unwrap();
    let before_weights = layer.ws.detach().copy();
    let before = loss_of(&layer);
    opt.zero_grad();
    before.backward();
    let grad = layer.ws.grad().copy();
    opt.step();

    let step = (&layer.ws.detach() - before_weights).to(Device::Cpu);
    let expected = grad.sign().to(Device::Cpu) * -lr;
    let off = (step - expected).abs().max().double_value(&[]);
    assert!(off < 1e-6, "AdamW first step off by {off}");
    let after = tch::no_grad(|| loss_of(&layer)).double_value(&[]);
    assert!(
        after < before.double_value(&[]),
        "loss did not fall: {after}"
    );
}

#[test]
fn adamw_step_on_cpu() {
    adamw_step_lowers_loss(Device::Cpu);
}

#[test]
fn adamw_step_on_cuda() {
    if !tch::Cuda::is_available() {
        println!("SKIPPED adamw_step_on_cuda: tch::Cuda::is_available() is false (no GPU visible to libtorch)");
        return;
    }
    adamw_step_lowers_loss(Device::Cuda(0));
}

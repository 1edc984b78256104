//! The dynamic loss scale against megatron-core 0.8.0's `DynamicGradScaler`, from the
//! same overflow flags (fixture: `cargo xtask fixtures`,
//! xtask/fixtures/loss_scale_fixtures.py): the same scale and trackers after every step.

use synerfuse_train::loss_scale::{DynamicLossScale, GradScaler, LossScaling, ScalerState};

#[derive(serde::Deserialize)]
struct Fixture {
    cases: Vec<Case>,
}

#[derive(serde::Deserialize)]
struct Case {
    initial: f64,
    min: f64,
    window: u64,
    hysteresis: u64,
    found_inf: Vec<bool>,
    after: Vec<After>,
}

#[derive(serde::Deserialize)]
struct After {
    scale: f64,
    growth_tracker: u64,
    hysteresis_tracker: i64,
}

#[test]
fn the_scale_follows_megatron_cores_dynamic_grad_scaler() {
    let text = include_str!("fixtures/loss_scale.json");
    let fixture: Fixture = serde_json::from_str(text).expect("fixture");
    assert_eq!(fixture.cases.len(), 5);
    for (c, case) in fixture.cases.iter().enumerate() {
        let mut scaler = GradScaler::new(LossScaling::Dynamic(DynamicLossScale {
            initial: case.initial as f32,
            min: case.min as f32,
            window: case.window,
            hysteresis: case.hysteresis,
        }));
        for (step, (&found_inf, want)) in case.found_inf.iter().zip(&case.after).enumerate() {
            scaler.update(found_inf);
            let want = ScalerState {
                scale: want.scale as f32,
                growth_tracker: want.growth_tracker,
                hysteresis_tracker: want.hysteresis_tracker,
            };
            assert_eq!(scaler.state(), want, "case {c}, step {step}");
        }
    }
}

//! Every group kind against megatron-core 0.8.0's RankGenerator (fixtures from
//! `cargo xtask fixtures`, xtask/fixtures/parallel_fixtures.py): same groups, same member
//! order, for many sizes and six rank orders.

use synerfuse_plan::{GroupKind, Topology};

#[test]
fn groups_equal_megatrons() {
    let text = std::fs::read_to_string("tests/fixtures/rank_generator.json").unwrap();
    let fixture: serde_json::Value = serde_json::from_str(&text).unwrap();
    let cases = fixture["cases"].as_array().unwrap();
    assert!(cases.len() > 200);
    for case in cases {
        let n = |k: &str| case[k].as_u64().unwrap() as usize;
        let order = case["order"].as_str().unwrap();
        let topology = Topology::new(n("world_size"), n("tp"), n("pp"), n("cp"), n("ep"), order)
            .unwrap_or_else(|e| panic!("{case}: {e}"));
        let groups = case["groups"].as_object().unwrap();
        assert_eq!(groups.len(), GroupKind::ALL.len());
        for (name, expected) in groups {
            let kind: GroupKind = name.parse().unwrap();
            let expected: Vec<Vec<usize>> = serde_json::from_value(expected.clone()).unwrap();
            assert_eq!(
                topology.groups(kind),
                expected,
                "{name} of world {} tp {} pp {} cp {} ep {} order {order}",
                n("world_size"),
                n("tp"),
                n("pp"),
                n("cp"),
                n("ep")
            );
        }
    }
}

//! Heterogeneous parallel plans for synerfuse, in pure Rust.
//!
//! Planning is pure: it turns a model, a batch and a cluster into a layout, and can be
//! tested and property-checked without libtorch or MPI. Users `cargo add` this crate
//! into their own launchers and planners.
//!
//! What is here today: [`StageLayout`], the number of decoder layers each pipeline
//! stage holds. Unlike a homogeneous pipeline, stages may differ, so a fast device can
//! carry more layers than a slow one.
//!
//! ```
//! use synerfuse_parallel::StageLayout;
//!
//! // 16 layers over 4 stages: two fast devices take 5 each, two slow ones 3 each.
//! let layout = StageLayout::new(vec![5, 5, 3, 3], 16).unwrap();
//! assert_eq!(layout.layer_range(2), 10..13);
//! assert_eq!(StageLayout::uniform(16, 4).unwrap().layers(), &[4, 4, 4, 4]);
//! ```

mod stage;

pub use stage::{LayoutError, StageLayout};

//! Moving a run's state between plans by element ranges (the re-planner's switch): every
//! rank offers the pieces it holds (what it would write to a checkpoint), says which
//! regions the new plan's restore reads, and each holder sends each reader exactly the
//! elements they share, point to point. Nothing is gathered whole, nothing touches disk.

use super::broadcast::broadcast_bytes;
use crate::checkpoint::region::{CopyOp, Region};
use crate::checkpoint::shard::PieceToWrite;
use crate::checkpoint::{self, CheckpointProblem, CheckpointState, StateSource};
use crate::comm::MpiCommunicator;
use crate::TrainError;
use serde::{Deserialize, Serialize};
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use synerfuse_model::tch::{Device, Kind, Tensor};

/// The tag of the state's messages (the pipelines are idle during a switch).
const TAG: i32 = 7_301;

/// Elements per message (1 GiB of fp32: MPI counts in `int`).
const MESSAGE_ELEMENTS: i64 = 1 << 28;

/// A region of a global tensor, as ranks describe what they hold and want.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub(super) struct RegionOf {
    name: String,
    shape: Vec<i64>,
    region: Region,
}

/// A dry run's source: records the regions a restore reads, in order, answering zeros.
pub(super) struct Recorder {
    reads: RefCell<Vec<RegionOf>>,
    state: CheckpointState,
    origin: PathBuf,
}

impl Recorder {
    pub(super) fn new(state: CheckpointState, origin: PathBuf) -> Self {
        Recorder {
            reads: RefCell::new(Vec::new()),
            state,
            origin,
        }
    }

    /// The regions read, in order.
    pub(super) fn reads(self) -> Vec<RegionOf> {
        self.reads.into_inner()
    }
}

impl StateSource for Recorder {
    fn read(&self, name: &str, shape: &[i64], region: &Region) -> Result<Tensor, TrainError> {
        self.reads.borrow_mut().push(RegionOf {
            name: name.to_owned(),
            shape: shape.to_vec(),
            region: region.clone(),
        });
        Ok(Tensor::zeros([region.len()], (Kind::Float, Device::Cpu)))
    }

    fn state(&self) -> &CheckpointState {
        &self.state
    }

    fn origin(&self) -> &Path {
        &self.origin
    }
}

/// The regions a rank asked for, filled from the ranks that held them.
pub(super) struct MovedState {
    tensors: HashMap<RegionOf, Tensor>,
    state: CheckpointState,
    origin: PathBuf,
}

impl StateSource for MovedState {
    fn read(&self, name: &str, shape: &[i64], region: &Region) -> Result<Tensor, TrainError> {
        let key = RegionOf {
            name: name.to_owned(),
            shape: shape.to_vec(),
            region: region.clone(),
        };
        self.tensors
            .get(&key)
            .map(Tensor::shallow_clone)
            .ok_or_else(|| {
                let missing = CheckpointProblem::MissingTensor {
                    prefix: String::new(),
                    name: name.to_owned(),
                };
                checkpoint::problem_at(&self.origin, missing)
            })
    }

    fn state(&self) -> &CheckpointState {
        &self.state
    }

    fn origin(&self) -> &Path {
        &self.origin
    }
}

/// `bytes` of every rank, on every rank (one broadcast per rank).
fn all_bytes(world: &MpiCommunicator, bytes: &[u8]) -> Result<Vec<Vec<u8>>, TrainError> {
    (0..world.size())
        .map(|root| broadcast_bytes(world, bytes, root))
        .collect()
}

fn all_json<T: Serialize + for<'de> Deserialize<'de>>(
    world: &MpiCommunicator,
    value: &T,
) -> Result<Vec<T>, TrainError> {
    let bytes = serde_json::to_vec(value).expect("metadata serialises");
    (all_bytes(world, &bytes)?.iter())
        .map(|b| Ok(serde_json::from_slice(b).expect("every rank sends the same type")))
        .collect()
}

/// The copies from `held` (a holder's pieces, in order) into `wanted` (a reader's
/// regions, in order), as (wanted index, held index, copy): the order both sides pack
/// and unpack a message in.
fn copies(held: &[RegionOf], wanted: &[RegionOf]) -> Vec<(usize, usize, CopyOp)> {
    let mut by_name: HashMap<&str, Vec<usize>> = HashMap::new();
    for (h, piece) in held.iter().enumerate() {
        by_name.entry(piece.name.as_str()).or_default().push(h);
    }
    let mut out = Vec::new();
    for (w, want) in wanted.iter().enumerate() {
        for &h in by_name.get(want.name.as_str()).into_iter().flatten() {
            let ops = held[h].region.copies_into(&want.region, &want.shape);
            out.extend(ops.into_iter().map(|op| (w, h, op)));
        }
    }
    out
}

/// The elements `op` reads from `data` (a piece's flat data), dense.
fn extract(data: &Tensor, op: &CopyOp) -> Tensor {
    let span = op.source_span();
    let source = data.narrow(0, span.start, span.end - span.start);
    match op.rows {
        1 => source.narrow(0, 0, op.cols),
        _ => (source.as_strided([op.rows, op.cols], [op.source.1, 1], None::<i64>)).reshape([-1]),
    }
}

/// Every rank's `wanted` regions filled from every rank's `held` pieces. Collective.
pub(super) fn exchange(
    world: &MpiCommunicator,
    held: &[PieceToWrite],
    wanted: Vec<RegionOf>,
    state: CheckpointState,
    origin: PathBuf,
) -> Result<MovedState, TrainError> {
    let me = world.rank();
    let mine: Vec<RegionOf> = (held.iter())
        .map(|p| RegionOf {
            name: p.name.clone(),
            shape: p.shape.clone(),
            region: p.region.clone(),
        })
        .collect();
    let all_held = all_json(world, &mine)?;
    let all_wanted = all_json(world, &wanted)?;
    let flat: Vec<Tensor> = (held.iter())
        .map(|p| {
            p.data
                .detach()
                .reshape([-1])
                .to_kind(Kind::Float)
                .to_device(Device::Cpu)
        })
        .collect();
    let mut sends = Vec::new();
    let mut local = None;
    for (dest, wants) in all_wanted.iter().enumerate() {
        let parts: Vec<Tensor> = (copies(&mine, wants).iter())
            .map(|(_, h, op)| extract(&flat[*h], op))
            .collect();
        if parts.is_empty() {
            continue;
        }
        let buffer = Tensor::cat(&parts, 0);
        if dest == me {
            local = Some(buffer);
            continue;
        }
        for start in (0..buffer.numel() as i64).step_by(MESSAGE_ELEMENTS as usize) {
            let n = MESSAGE_ELEMENTS.min(buffer.numel() as i64 - start);
            sends.push(world.isend(&buffer.narrow(0, start, n), dest, TAG)?);
        }
    }
    drop(flat);
    let targets: Vec<Tensor> = (wanted.iter())
        .map(|w| Tensor::zeros([w.region.len()], (Kind::Float, Device::Cpu)))
        .collect();
    let mut covered = vec![0i64; wanted.len()];
    for (source, pieces) in all_held.iter().enumerate() {
        let ops = copies(pieces, &wanted);
        let total: i64 = ops.iter().map(|(_, _, op)| op.len()).sum();
        if total == 0 {
            continue;
        }
        let buffer = match source == me {
            true => local.take().unwrap_or_else(Tensor::new),
            false => receive(world, source, total)?,
        };
        let mut at = 0;
        for (w, _, op) in ops {
            let dense = CopyOp {
                source: (0, op.cols),
                ..op
            };
            copy_block(&buffer.narrow(0, at, op.len()), &targets[w], &dense);
            covered[w] += op.len();
            at += op.len();
        }
    }
    for send in sends {
        send.wait();
    }
    for (want, covered) in wanted.iter().zip(&covered) {
        checkpoint::check_coverage(&want.name, *covered, want.region.len(), &origin)?;
    }
    Ok(MovedState {
        tensors: wanted.into_iter().zip(targets).collect(),
        state,
        origin,
    })
}

/// `total` fp32 elements from `source`, in messages of at most [`MESSAGE_ELEMENTS`].
fn receive(world: &MpiCommunicator, source: usize, total: i64) -> Result<Tensor, TrainError> {
    let mut parts = Vec::new();
    for start in (0..total).step_by(MESSAGE_ELEMENTS as usize) {
        let n = MESSAGE_ELEMENTS.min(total - start);
        let mut part = Tensor::zeros([n], (Kind::Float, Device::Cpu));
        world.recv(&mut part, source, TAG)?;
        parts.push(part);
    }
    Ok(Tensor::cat(&parts, 0))
}

/// Copies `op`'s rectangle from `source` (flat, starting at `op`'s first source
/// element) into `target` (the flat data of the target region).
fn copy_block(source: &Tensor, target: &Tensor, op: &CopyOp) {
    let strided = |t: &Tensor, stride: i64| match op.rows {
        1 => t.narrow(0, 0, op.cols).view([1, op.cols]),
        _ => t.as_strided([op.rows, op.cols], [stride, 1], None::<i64>),
    };
    let span = (op.rows - 1) * op.target.1 + op.cols;
    let mut to = strided(&target.narrow(0, op.target.0, span), op.target.1);
    tch::no_grad(|| to.copy_(&strided(source, op.source.1)));
}

//! The collectives every parallel form of a stage speaks (tensor, context and expert
//! parallelism alike), provided by the caller: MPI/NCCL in synerfuse-train, threads in
//! the tests. At the bottom, with the error, so that `tp`, `cp` and `moe` share them
//! without importing one another.

use crate::error::StageError;
use tch::Tensor;

/// A collective's failure, as the communicator reports it.
pub type CollectiveError = Box<dyn std::error::Error + Send + Sync>;

/// The collectives a tensor-parallel stage needs, over its tensor-parallel group
/// (implemented over MPI/NCCL by synerfuse-train, and over threads in tests). Members are
/// numbered in the collectives' order, which sequence parallelism follows (the group's
/// member order need not be its tensor-parallel order).
pub trait TpCollectives {
    /// This member's index in the collectives' order.
    fn rank(&self) -> usize;
    /// Members.
    fn size(&self) -> usize;
    /// The element-wise sum over the group, as a new tensor.
    fn all_reduce_sum(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError>;
    /// Every member's tensor stacked along a new first dimension, in member order.
    fn all_gather(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError>;
    /// The element-wise sum over the group, cut into `size` equal parts along the first
    /// dimension: this member's part.
    fn reduce_scatter_sum(&self, tensor: &Tensor) -> Result<Tensor, CollectiveError>;
    /// `parts[m]` to member `m` (any number of rows along the first dimension, the rest
    /// of the shape and the dtype alike on every member): what each member sent this one,
    /// in member order (expert parallelism's token exchange).
    fn all_to_all(&self, parts: &[Tensor]) -> Result<Vec<Tensor>, CollectiveError>;
}

/// What a training forward waits on before each model piece runs.
pub trait PieceGate {
    /// Returns once the parameters of model piece `piece` may be read (0 the embedding,
    /// `l + 1` decoder layer `l`, `num_layers + 1` the final norm and output layer; see
    /// [`synerfuse_plan::parameter_piece`]).
    fn before_piece(&self, piece: usize) -> Result<(), CollectiveError>;
}

/// The gate of a forward whose parameters are all in place: never waits.
pub struct OpenGate;

impl PieceGate for OpenGate {
    fn before_piece(&self, _piece: usize) -> Result<(), CollectiveError> {
        Ok(())
    }
}

/// [`TpCollectives::all_to_all`] built from the group's all-gather (every part padded to
/// the longest and gathered whole): size times the traffic of a real all-to-all, for
/// groups without one (tests over threads).
pub fn all_to_all_by_gather(
    group: &dyn TpCollectives,
    parts: &[Tensor],
) -> Result<Vec<Tensor>, CollectiveError> {
    let rows: Vec<i64> = parts.iter().map(|p| p.size()[0]).collect();
    let counts = group.all_gather(&Tensor::from_slice(&rows))?;
    let counts: Vec<Vec<i64>> = (0..group.size())
        .map(|src| Vec::try_from(counts.get(src as i64)).unwrap_or_default())
        .collect();
    let longest = counts.iter().flatten().copied().max().unwrap_or(0);
    let padded: Vec<Tensor> = (parts.iter())
        .map(|p| {
            let mut shape = p.size();
            shape[0] = longest - shape[0];
            Tensor::cat(
                &[
                    p.shallow_clone(),
                    p.new_zeros(shape.as_slice(), (p.kind(), p.device())),
                ],
                0,
            )
        })
        .collect();
    let all = group.all_gather(&Tensor::stack(&padded, 0))?;
    let me = group.rank();
    Ok((0..group.size())
        .map(|src| {
            all.get(src as i64)
                .get(me as i64)
                .narrow(0, 0, counts[src][me])
        })
        .collect())
}

/// A collective's `result`, its failure named `op` as a [`StageError`].
pub(crate) fn collective<T>(
    op: &'static str,
    result: Result<T, CollectiveError>,
) -> Result<T, StageError> {
    result.map_err(|source| StageError::Collective { op, source })
}

/// Flattens `tensors` into one buffer, lets `reduce` combine it in place (one collective
/// for them all), and copies the result back into each tensor.
pub fn reduce_flat_in_place<E>(
    tensors: &mut [Tensor],
    reduce: impl FnOnce(&mut Tensor) -> Result<(), E>,
) -> Result<(), E> {
    if tensors.is_empty() {
        return Ok(());
    }
    let mut flat = Tensor::cat(
        &tensors.iter().map(|g| g.reshape([-1])).collect::<Vec<_>>(),
        0,
    );
    reduce(&mut flat)?;
    let mut offset = 0;
    tch::no_grad(|| {
        for tensor in tensors.iter_mut() {
            let n = tensor.numel() as i64;
            tensor.copy_(&flat.narrow(0, offset, n).view(tensor.size().as_slice()));
            offset += n;
        }
    });
    Ok(())
}

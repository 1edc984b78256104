//! Which elements of a whole tensor a stored piece holds, or a rank wants, and the
//! copies that move one into the other.
//!
//! A rank holds a tensor-parallel slice of a parameter (rows or columns of the whole,
//! see [`synerfuse_model::Stage::shard_of`]) and, under the distributed optimizer, only
//! a flat range of that slice's masters and moments. A [`Region`] says both; any two
//! regions of one tensor meet in at most nine rectangles of the whole (each region is at
//! most three: a partial first row, whole rows, a partial last row), so moving state
//! between plans is a few strided copies per tensor, never an element loop.

use serde::{Deserialize, Serialize};
use std::ops::Range;

/// A tensor-parallel slice of a whole tensor: `start..end` along dimension `dim`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Slice {
    /// 0 (rows) or 1 (columns of a matrix).
    pub dim: usize,
    /// First index.
    pub start: i64,
    /// One past the last.
    pub end: i64,
}

/// Elements of a whole tensor: the flat range `flat` (row-major) of the slice `slice`
/// (or of the whole tensor).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Region {
    /// The tensor-parallel slice, `None` for the whole tensor.
    pub slice: Option<Slice>,
    /// Elements of the slice, in its row-major order.
    pub flat: Range<i64>,
}

/// One strided copy: `rows` runs of `cols` elements, from `source` (element offset,
/// row stride) to `target` (element offset, row stride), in the flat data of the two
/// regions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopyOp {
    /// First element in the source region's data, and its row stride.
    pub source: (i64, i64),
    /// First element in the target region's data, and its row stride.
    pub target: (i64, i64),
    /// Rows copied.
    pub rows: i64,
    /// Elements per row.
    pub cols: i64,
}

impl CopyOp {
    /// Elements copied.
    pub fn len(&self) -> i64 {
        self.rows * self.cols
    }

    /// Whether it copies nothing.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The span of source elements it reads (first, one past the last).
    pub fn source_span(&self) -> Range<i64> {
        let (start, stride) = self.source;
        start..start + (self.rows - 1) * stride + self.cols
    }
}

/// A rectangle of the whole tensor seen as a matrix, with where its first element sits
/// in a region's flat data and that data's row stride.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Block {
    rows: Range<i64>,
    cols: Range<i64>,
    /// Offset in the region's data of element (rows.start, cols.start).
    at: i64,
    stride: i64,
}

/// The whole tensor `shape` as a matrix (rows, columns): a vector is one column.
fn matrix(shape: &[i64]) -> (i64, i64) {
    let rows = shape.first().copied().unwrap_or(1);
    let cols = shape.iter().skip(1).product::<i64>();
    (rows, cols)
}

impl Region {
    /// The whole tensor of `shape`.
    pub fn whole(shape: &[i64]) -> Region {
        Region {
            slice: None,
            flat: 0..shape.iter().product(),
        }
    }

    /// All of the slice `slice` (`None`: the whole) of a tensor of `shape`.
    pub fn of_slice(shape: &[i64], slice: Option<Slice>) -> Region {
        let (rows, cols) = Self::slice_box(shape, slice.as_ref());
        Region {
            slice,
            flat: 0..(rows.end - rows.start) * (cols.end - cols.start),
        }
    }

    /// The elements `flat` of this region's slice (a flat range within it).
    pub fn narrowed(&self, flat: Range<i64>) -> Region {
        Region {
            slice: self.slice.clone(),
            flat,
        }
    }

    /// Elements.
    pub fn len(&self) -> i64 {
        self.flat.end - self.flat.start
    }

    /// Whether it holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() <= 0
    }

    /// Whether it fits a tensor of `shape` (non-negative, its element count within
    /// `i64`): its slice within the dimension, its flat range within the slice (what a
    /// manifest read from disk is checked against).
    pub fn fits(&self, shape: &[i64]) -> bool {
        let (rows, cols) = matrix(shape);
        let slice_ok = match &self.slice {
            None => true,
            Some(s) => {
                let extent = match s.dim {
                    0 => rows,
                    1 if shape.len() == 2 => cols,
                    _ => return false,
                };
                0 <= s.start && s.start <= s.end && s.end <= extent
            }
        };
        if !slice_ok {
            return false;
        }
        let (r, c) = Self::slice_box(shape, self.slice.as_ref());
        let numel = (r.end - r.start) * (c.end - c.start);
        0 <= self.flat.start && self.flat.start <= self.flat.end && self.flat.end <= numel
    }

    /// The rows and columns of the whole matrix the slice covers.
    fn slice_box(shape: &[i64], slice: Option<&Slice>) -> (Range<i64>, Range<i64>) {
        let (rows, cols) = matrix(shape);
        match slice {
            Some(Slice { dim: 0, start, end }) => (*start..*end, 0..cols),
            Some(Slice { start, end, .. }) => (0..rows, *start..*end),
            None => (0..rows, 0..cols),
        }
    }

    /// Its elements as at most three rectangles of the whole matrix.
    fn blocks(&self, shape: &[i64]) -> Vec<Block> {
        let (rows, cols) = Self::slice_box(shape, self.slice.as_ref());
        let width = cols.end - cols.start;
        if self.is_empty() || width == 0 {
            return Vec::new();
        }
        let (s, e) = (self.flat.start, self.flat.end);
        let (first, last) = (s / width, (e - 1) / width);
        let block = |row: Range<i64>, col: Range<i64>| Block {
            at: row.start * width + col.start - s,
            rows: rows.start + row.start..rows.start + row.end,
            cols: cols.start + col.start..cols.start + col.end,
            stride: width,
        };
        if first == last {
            return vec![block(first..first + 1, s % width..(e - 1) % width + 1)];
        }
        let mut out = Vec::with_capacity(3);
        let mut middle = first..last + 1;
        if s % width != 0 {
            out.push(block(first..first + 1, s % width..width));
            middle.start += 1;
        }
        let tail = (e % width != 0).then(|| block(last..last + 1, 0..e % width));
        if tail.is_some() {
            middle.end -= 1;
        }
        if middle.start < middle.end {
            out.push(block(middle, 0..width));
        }
        out.extend(tail);
        out
    }

    /// The copies that fill the part of `target` this region holds, for a tensor of
    /// whole shape `shape`; their lengths sum to the elements the two share.
    pub fn copies_into(&self, target: &Region, shape: &[i64]) -> Vec<CopyOp> {
        let mut out = Vec::new();
        let targets = target.blocks(shape);
        for s in self.blocks(shape) {
            for t in &targets {
                let rows = s.rows.start.max(t.rows.start)..s.rows.end.min(t.rows.end);
                let cols = s.cols.start.max(t.cols.start)..s.cols.end.min(t.cols.end);
                if rows.start >= rows.end || cols.start >= cols.end {
                    continue;
                }
                let offset = |b: &Block| {
                    b.at + (rows.start - b.rows.start) * b.stride + (cols.start - b.cols.start)
                };
                out.push(CopyOp {
                    source: (offset(&s), s.stride),
                    target: (offset(t), t.stride),
                    rows: rows.end - rows.start,
                    cols: cols.end - cols.start,
                });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    /// Brute force: the whole tensor's flat index of each of the region's elements.
    fn elements(region: &Region, shape: &[i64]) -> Vec<i64> {
        let (rows, cols) = Region::slice_box(shape, region.slice.as_ref());
        let (_, whole_cols) = matrix(shape);
        let width = cols.end - cols.start;
        region
            .flat
            .clone()
            .map(|k| (rows.start + k / width) * whole_cols + cols.start + k % width)
            .collect()
    }

    fn region(shape: (i64, i64)) -> impl Strategy<Value = Region> {
        let (rows, cols) = shape;
        (
            0usize..3,
            0..=rows,
            0..=rows,
            0..=cols,
            0..=cols,
            0.0..1.0f64,
            0.0..1.0f64,
        )
            .prop_map(move |(kind, r0, r1, c0, c1, a, b)| {
                let slice = match kind {
                    0 => None,
                    1 => Some(Slice {
                        dim: 0,
                        start: r0.min(r1),
                        end: r0.max(r1),
                    }),
                    _ => Some(Slice {
                        dim: 1,
                        start: c0.min(c1),
                        end: c0.max(c1),
                    }),
                };
                let all = Region::of_slice(&[rows, cols], slice);
                let n = all.len() as f64;
                let (x, y) = ((a * n) as i64, (b * n) as i64);
                all.narrowed(x.min(y)..x.max(y))
            })
    }

    proptest! {
        /// The copies move exactly the shared elements, each to its place.
        #[test]
        fn copies_move_exactly_the_shared_elements(
            (shape, source, target) in (1i64..7, 1i64..7)
                .prop_flat_map(|s| (Just(s), region(s), region(s)))
        ) {
            let shape = [shape.0, shape.1];
            let (from, to) = (elements(&source, &shape), elements(&target, &shape));
            let mut filled: BTreeMap<i64, i64> = BTreeMap::new();
            for op in source.copies_into(&target, &shape) {
                for r in 0..op.rows {
                    for c in 0..op.cols {
                        let s = op.source.0 + r * op.source.1 + c;
                        let t = op.target.0 + r * op.target.1 + c;
                        prop_assert!(filled.insert(t, from[s as usize]).is_none(), "target {t} twice");
                    }
                }
            }
            let shared: BTreeMap<i64, i64> = to.iter().enumerate()
                .filter(|(_, e)| from.contains(e))
                .map(|(i, e)| (i as i64, *e))
                .collect();
            prop_assert_eq!(filled, shared);
        }
    }

    #[test]
    fn a_vector_is_one_column() {
        let shape = [10];
        let source = Region::whole(&shape).narrowed(2..7);
        let target = Region::of_slice(
            &shape,
            Some(Slice {
                dim: 0,
                start: 5,
                end: 9,
            }),
        );
        let ops = source.copies_into(&target, &shape);
        assert_eq!(ops.iter().map(CopyOp::len).sum::<i64>(), 2);
        assert!(Region::whole(&shape).fits(&shape));
        assert!(!Region::whole(&[11]).fits(&shape));
    }
}

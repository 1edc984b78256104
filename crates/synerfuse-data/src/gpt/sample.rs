//! One GPT sample: its tokens read through the indices, and the model inputs built
//! from them (Megatron's `_query_document_sample_shuffle_indices` and `__getitem__`).

use super::DocumentSource;
use super::GptIndices;
use crate::DataError;

/// How a sample becomes model inputs (Megatron's dataset flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampleOptions {
    /// `--seq-length`.
    pub sequence_length: usize,
    /// Samples carry one extra token (labels are the tokens shifted by one).
    pub add_extra_token: bool,
    /// The tokenizer's end-of-document id.
    pub eod: i64,
    /// The tokenizer's pad id; Megatron uses −1 when the tokenizer has none.
    pub pad: i64,
    /// `--reset-position-ids`: positions restart after every EOD.
    pub reset_position_ids: bool,
    /// `--reset-attention-mask`: no attention across an EOD.
    pub reset_attention_mask: bool,
    /// `--eod-mask-loss`: no loss where the *token* is EOD.
    pub eod_mask_loss: bool,
    /// Build the `[S, S]` attention mask (Megatron's default; off with
    /// `--no-create-attention-mask-in-dataloader`).
    pub create_attention_mask: bool,
}

/// Model inputs for one sample.
#[derive(Debug, Clone, PartialEq)]
pub struct GptSample {
    /// Input ids, pads replaced by 0.
    pub tokens: Vec<i64>,
    /// Target ids, pads replaced by 0.
    pub labels: Vec<i64>,
    /// 1 where the loss counts.
    pub loss_mask: Vec<f32>,
    /// Position of each token.
    pub position_ids: Vec<i64>,
    /// Row-major `[S, S]`, `true` where query q may NOT attend to key k.
    pub attention_mask: Option<Vec<bool>>,
}

/// The `S + X` token ids of sample `idx` (in served order), padded with `pad` when the
/// last partial sample is short.
pub fn sample_tokens(
    dataset: &dyn DocumentSource,
    indices: &GptIndices,
    idx: usize,
    options: &SampleOptions,
) -> Result<Vec<i64>, DataError> {
    let out_of_range = || DataError::OutOfRange {
        path: dataset.origin().to_path_buf(),
        what: "sequence",
        detail: format!("sample {idx} of {}", indices.shuffle_index.len()),
    };
    let j = indices.shuffle_index.get(idx).ok_or_else(out_of_range)?;
    let ([begin, begin_offset], [end, end_offset]) =
        match (indices.sample_index.get(j), indices.sample_index.get(j + 1)) {
            (Some(&b), Some(&e)) => (b, e),
            _ => return Err(out_of_range()),
        };
    let x = i64::from(options.add_extra_token);
    let sequence = |position: i64| -> Result<usize, DataError> {
        indices
            .document_index
            .get(position as usize)
            .map(|&id| id as usize)
            .ok_or_else(out_of_range)
    };
    let mut text = Vec::with_capacity(options.sequence_length + 1);
    if begin == end {
        text.extend(dataset.get_i64(
            sequence(begin)?,
            begin_offset as usize,
            Some((end_offset - begin_offset + x) as usize),
        )?);
    } else {
        text.extend(dataset.get_i64(sequence(begin)?, begin_offset as usize, None)?);
        for position in begin + 1..end {
            text.extend(dataset.get_i64(sequence(position)?, 0, None)?);
        }
        text.extend(dataset.get_i64(sequence(end)?, 0, Some((end_offset + x) as usize))?);
    }
    let wanted = options.sequence_length + options.add_extra_token as usize;
    if text.len() < wanted {
        text.resize(wanted, options.pad);
    }
    Ok(text)
}

/// Tokens, labels, masks and positions of a sample's `text`, as Megatron builds them.
///
/// Megatron caches the masks when no reset or EOD flag is set and then mutates the
/// cached loss mask in place for padded samples, leaking zeros into later samples; every
/// sample here gets its own.
pub fn build_sample(text: &[i64], options: &SampleOptions) -> GptSample {
    let (tokens, mut labels): (Vec<i64>, Vec<i64>) = if options.add_extra_token {
        (text[..text.len() - 1].to_vec(), text[1..].to_vec())
    } else {
        let mut labels: Vec<i64> = text[1..].to_vec();
        labels.push(options.pad);
        (text.to_vec(), labels)
    };
    let n = tokens.len();
    let mut loss_mask = vec![1.0f32; n];
    if options.eod_mask_loss {
        for (mask, &token) in loss_mask.iter_mut().zip(&tokens) {
            if token == options.eod {
                *mask = 0.0;
            }
        }
    }
    let mut position_ids: Vec<i64> = (0..n as i64).collect();
    let mut allowed = options.create_attention_mask.then(|| {
        let mut lower = vec![false; n * n];
        for q in 0..n {
            for k in 0..=q {
                lower[q * n + k] = true;
            }
        }
        lower
    });
    if options.reset_position_ids || options.reset_attention_mask {
        let mut previous = 0i64;
        for i in (0..n).filter(|&i| tokens[i] == options.eod) {
            if options.reset_attention_mask {
                if let Some(allowed) = allowed.as_mut() {
                    for q in i + 1..n {
                        for k in 0..=i {
                            allowed[q * n + k] = false;
                        }
                    }
                }
            }
            if options.reset_position_ids {
                let shift = i as i64 + 1 - previous;
                for position in &mut position_ids[i + 1..] {
                    *position -= shift;
                }
                previous = i as i64 + 1;
            }
        }
    }
    for (mask, &label) in loss_mask.iter_mut().zip(&labels) {
        if label == options.pad {
            *mask = 0.0;
        }
    }
    let tokens = tokens
        .into_iter()
        .map(|t| if t == options.pad { 0 } else { t })
        .collect();
    for label in &mut labels {
        if *label == options.pad {
            *label = 0;
        }
    }
    GptSample {
        tokens,
        labels,
        loss_mask,
        position_ids,
        attention_mask: allowed.map(|a| a.into_iter().map(|ok| !ok).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpt::build_gpt_indices;
    use crate::gpt::index::WORKED_EXAMPLE;
    use crate::{DType, IndexedDataset, IndexedDatasetBuilder};

    fn options(flags: bool) -> SampleOptions {
        SampleOptions {
            sequence_length: 4,
            add_extra_token: true,
            eod: 786,
            pad: -1,
            reset_position_ids: flags,
            reset_attention_mask: flags,
            eod_mask_loss: flags,
            create_attention_mask: true,
        }
    }

    /// The samples megatron-core 0.8.0 serves for the worked example.
    #[test]
    fn worked_example_samples() {
        let dir = std::env::temp_dir().join(format!("synerfuse-gpt-sample-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let prefix = dir.join("tiny");
        let mut builder = IndexedDatasetBuilder::create(&prefix, DType::U16).unwrap();
        for doc in [
            &[1u32, 2, 3, 4, 786][..],
            &[5, 6, 786],
            &[7, 8, 9, 10, 11, 12, 786],
            &[13, 14, 15, 786],
        ] {
            builder.add_document(doc, &[doc.len()]).unwrap();
        }
        builder.finalize().unwrap();
        let ds = IndexedDataset::open(&prefix).unwrap();
        let sizes: Vec<i32> = ds.sequence_lengths().to_vec();
        let indices = build_gpt_indices(&sizes, &[0, 1, 2, 3], &WORKED_EXAMPLE).unwrap();
        let expected: [(usize, [i64; 5]); 5] = [
            (0, [1, 2, 3, 4, 786]),
            (1, [7, 8, 9, 10, 11]),
            (2, [11, 12, 786, 13, 14]),
            (3, [786, 5, 6, 786, 7]),
            (8, [6, 786, 7, 8, 9]),
        ];
        for (idx, text) in expected {
            assert_eq!(
                sample_tokens(&ds, &indices, idx, &options(false)).unwrap(),
                text,
                "sample {idx}"
            );
        }
        assert!(sample_tokens(&ds, &indices, 9, &options(false)).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Megatron's `GPTDataset` with every mask and reset flag on, and a padded sample.
    #[test]
    fn masks_and_positions_with_every_flag() {
        let mut opts = options(true);
        opts.sequence_length = 8;
        let sample = build_sample(&[5, 6, 786, 7, 8, 786, 9, -1, -1], &opts);
        assert_eq!(sample.tokens, [5, 6, 786, 7, 8, 786, 9, 0]);
        assert_eq!(sample.labels, [6, 786, 7, 8, 786, 9, 0, 0]);
        assert_eq!(sample.loss_mask, [1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]);
        assert_eq!(sample.position_ids, [0, 1, 2, 0, 1, 2, 0, 1]);
        let mask = sample.attention_mask.unwrap();
        // Masked iff k > q, or an EOD at i with k <= i < q.
        for q in 0..8 {
            for k in 0..8 {
                let across_eod = [2usize, 5].iter().any(|&i| k <= i && i < q);
                assert_eq!(mask[q * 8 + k], k > q || across_eod, "q {q} k {k}");
            }
        }
    }

    #[test]
    fn without_flags_only_pads_are_masked() {
        let sample = build_sample(&[5, 786, 7, -1, -1], &options(false));
        assert_eq!(sample.loss_mask, [1.0, 1.0, 0.0, 0.0]);
        assert_eq!(sample.position_ids, [0, 1, 2, 3]);
        let again = build_sample(&[5, 786, 7, 8, 9], &options(false));
        assert_eq!(
            again.loss_mask, [1.0; 4],
            "no mask leaks from an earlier padded sample"
        );
    }
}

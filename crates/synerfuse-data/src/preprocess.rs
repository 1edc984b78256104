//! JSONL → Megatron `.bin/.idx`, as Megatron's `tools/preprocess_data.py` writes them.
//!
//! A reader thread cuts the input into batches of lines; a pool of `workers` threads
//! parses and tokenizes each batch; the calling thread appends the results to one
//! builder per JSON key in input order. Memory is bounded by a few batches, whatever
//! the corpus size, and the output is the same for any worker count.

use crate::indexed::IndexedDatasetBuilder;
use crate::tokenizer::Tokenizer;
use crate::{DType, DataError};
use rayon::prelude::*;
use std::fs::File;
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::sync::mpsc::sync_channel;
use std::time::{Duration, Instant};

/// What to preprocess and how (Megatron's flag names in the docs).
#[derive(Debug, Clone)]
pub struct PreprocessConfig {
    /// `--input`: a JSONL file, optionally gzip-compressed (`.gz`).
    pub input: PathBuf,
    /// `--output-prefix`: outputs are `{prefix}_{key}_document.{bin,idx}`.
    pub output_prefix: PathBuf,
    /// `--json-keys` (Megatron's default is `text`).
    pub json_keys: Vec<String>,
    /// `--append-eod`: end each non-empty document with the tokenizer's `eod`.
    pub append_eod: bool,
    /// `--workers`: tokenizing threads.
    pub workers: usize,
    /// `--partitions`: Megatron deals lines round-robin into this many partitions and
    /// concatenates them, which reorders documents; reproduced for identical output.
    pub partitions: usize,
    /// `--keep-sequential-samples`: contiguous partitions, so input order is kept.
    pub keep_sequential_samples: bool,
    /// `--skip-bad-lines`: count malformed lines and go on instead of stopping.
    pub skip_bad_lines: bool,
}

/// Why preprocessing stopped.
#[derive(Debug, thiserror::Error)]
pub enum PreprocessError {
    /// A line that is not a JSON object with the keys asked for (and no `--skip-bad-lines`).
    #[error("{path}:{line}: {reason}")]
    BadLine {
        /// The input file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// What is wrong with it.
        reason: String,
    },
    /// No JSON key to tokenize.
    #[error("at least one JSON key is needed")]
    NoKeys,
    /// No worker or no partition.
    #[error("workers ({workers}) and partitions ({partitions}) must be at least 1")]
    NoWorkers {
        /// Worker threads.
        workers: usize,
        /// Partitions.
        partitions: usize,
    },
    /// Workers that do not divide evenly over the partitions.
    #[error("{workers} workers must be divisible by {partitions} partitions (each partition gets workers/partitions processes in Megatron)")]
    UnevenWorkers {
        /// Worker threads.
        workers: usize,
        /// Partitions.
        partitions: usize,
    },
    /// An end-of-document token asked of a tokenizer that has none.
    #[error("appending end-of-document tokens: this tokenizer has no end-of-document token")]
    NoEod,
    /// The worker pool could not be started.
    #[error("starting {workers} worker threads: {message}")]
    Pool {
        /// Worker threads asked for.
        workers: usize,
        /// The thread pool's message.
        message: String,
    },
    /// The thread reading the input died.
    #[error("the input reader thread panicked")]
    ReaderPanicked,
    /// Reading the input or writing the outputs failed.
    #[error(transparent)]
    Data(#[from] DataError),
}

/// Counters reported while preprocessing and at the end.
#[derive(Debug, Clone, Default)]
pub struct PreprocessStats {
    /// Input lines turned into documents.
    pub documents: u64,
    /// Lines skipped under `--skip-bad-lines`.
    pub bad_lines: u64,
    /// Bytes of input consumed (uncompressed).
    pub bytes: u64,
    /// Tokens written over all keys.
    pub tokens: u64,
    /// Time since the start.
    pub elapsed: Duration,
}

/// One line's documents, one per JSON key: flat tokens and sequence lengths.
type LineDocuments = Vec<(Vec<u32>, Vec<usize>)>;

/// The output prefix of one key: `{prefix}_{key}_document`.
pub fn output_prefix_for_key(prefix: &Path, key: &str) -> PathBuf {
    let mut name = prefix.as_os_str().to_owned();
    name.push(format!("_{key}_document"));
    PathBuf::from(name)
}

/// Lines per batch, and bytes after which a batch is cut early.
const BATCH_LINES: usize = 4096;
const BATCH_BYTES: usize = 8 << 20;

struct Batch {
    /// 1-based number of the first line.
    first_line: u64,
    /// Each line without its newline, or why it is not text.
    lines: Vec<Result<String, String>>,
}

fn open_input(path: &Path) -> Result<Box<dyn BufRead + Send>, DataError> {
    let file = File::open(path).map_err(DataError::io(path))?;
    let reader: Box<dyn Read + Send> = if path.extension().is_some_and(|e| e == "gz") {
        Box::new(flate2::read::MultiGzDecoder::new(file))
    } else {
        Box::new(file)
    };
    Ok(Box::new(BufReader::with_capacity(1 << 20, reader)))
}

/// Which input lines (0-based) go into the output, in output order: Megatron's
/// partition dealing, or every line once in order.
#[derive(Clone, Copy)]
enum LineOrder {
    /// Lines `i` with `i % count == part`, for `part` in `0..count`, one pass each.
    RoundRobin {
        count: u64,
    },
    InOrder,
}

/// Runs the whole preprocessing and calls `progress` after every batch.
pub fn preprocess(
    config: &PreprocessConfig,
    tokenizer: &dyn Tokenizer,
    mut progress: impl FnMut(&PreprocessStats),
) -> Result<PreprocessStats, PreprocessError> {
    let eod = check_config(config, tokenizer)?;
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(config.workers)
        .thread_name(|i| format!("preprocess-{i}"))
        .build()
        .map_err(|e| PreprocessError::Pool {
            workers: config.workers,
            message: e.to_string(),
        })?;
    let dtype = DType::optimal_for_vocab(tokenizer.vocab_size());
    let mut builders = config
        .json_keys
        .iter()
        .map(|key| {
            IndexedDatasetBuilder::create(output_prefix_for_key(&config.output_prefix, key), dtype)
        })
        .collect::<Result<Vec<_>, _>>()?;
    let order = if config.partitions > 1 && !config.keep_sequential_samples {
        LineOrder::RoundRobin {
            count: config.partitions as u64,
        }
    } else {
        // Contiguous partitions concatenated in order are the input order.
        LineOrder::InOrder
    };
    let passes = match order {
        LineOrder::RoundRobin { count } => count,
        LineOrder::InOrder => 1,
    };
    let started = Instant::now();
    let mut stats = PreprocessStats::default();
    for pass in 0..passes {
        let (sender, receiver) = sync_channel::<Result<Batch, DataError>>(2);
        let mut input = open_input(&config.input)?;
        let path = config.input.clone();
        let reader = std::thread::spawn(move || {
            read_batches(&mut *input, &path, order, pass, |batch| {
                sender.send(batch).is_ok()
            })
        });
        let mut writer = BatchWriter {
            config,
            builders: &mut builders,
            stats: &mut stats,
            line_of: |index| line_number(order, pass, index),
        };
        for batch in receiver {
            let batch = batch?;
            let encoded: Vec<Result<LineDocuments, String>> = pool.install(|| {
                batch
                    .lines
                    .par_iter()
                    .map(|line| {
                        let line = line.as_deref().map_err(Clone::clone)?;
                        encode_line(line, &config.json_keys, tokenizer, eod)
                    })
                    .collect()
            });
            writer.write(&batch, encoded)?;
            writer.stats.elapsed = started.elapsed();
            progress(writer.stats);
        }
        reader.join().map_err(|_| PreprocessError::ReaderPanicked)?;
    }
    for builder in builders {
        builder.finalize()?;
    }
    stats.elapsed = started.elapsed();
    Ok(stats)
}

/// Checks the settings against each other and the tokenizer; the end-of-document id to
/// append, if asked for.
fn check_config(
    config: &PreprocessConfig,
    tokenizer: &dyn Tokenizer,
) -> Result<Option<u32>, PreprocessError> {
    if config.json_keys.is_empty() {
        return Err(PreprocessError::NoKeys);
    }
    if config.workers == 0 || config.partitions == 0 {
        return Err(PreprocessError::NoWorkers {
            workers: config.workers,
            partitions: config.partitions,
        });
    }
    if config.workers % config.partitions != 0 {
        return Err(PreprocessError::UnevenWorkers {
            workers: config.workers,
            partitions: config.partitions,
        });
    }
    match (config.append_eod, tokenizer.eod()) {
        (true, None) => Err(PreprocessError::NoEod),
        (true, Some(eod)) => Ok(Some(eod)),
        (false, _) => Ok(None),
    }
}

/// Appends encoded lines to the outputs, in input order, counting as it goes.
struct BatchWriter<'a, F> {
    config: &'a PreprocessConfig,
    builders: &'a mut [IndexedDatasetBuilder],
    stats: &'a mut PreprocessStats,
    /// The input line number of the `index`-th line read in this pass.
    line_of: F,
}

impl<F: Fn(u64) -> u64> BatchWriter<'_, F> {
    fn write(
        &mut self,
        batch: &Batch,
        encoded: Vec<Result<LineDocuments, String>>,
    ) -> Result<(), PreprocessError> {
        for ((index, documents), text) in (batch.first_line..).zip(encoded).zip(&batch.lines) {
            self.stats.bytes += text.as_ref().map_or(0, |t| t.len() as u64 + 1);
            match documents {
                Ok(documents) => {
                    for (builder, (tokens, lengths)) in self.builders.iter_mut().zip(documents) {
                        self.stats.tokens += tokens.len() as u64;
                        builder.add_document(&tokens, &lengths)?;
                    }
                    self.stats.documents += 1;
                }
                Err(_) if self.config.skip_bad_lines => self.stats.bad_lines += 1,
                Err(reason) => {
                    return Err(PreprocessError::BadLine {
                        path: self.config.input.clone(),
                        line: (self.line_of)(index),
                        reason,
                    })
                }
            }
        }
        Ok(())
    }
}

/// The 1-based input line number of the `index`-th line (1-based) read in `pass`.
fn line_number(order: LineOrder, pass: u64, index: u64) -> u64 {
    match order {
        LineOrder::InOrder => index,
        LineOrder::RoundRobin { count } => (index - 1) * count + pass + 1,
    }
}

/// Reads the lines of this pass in batches; `send` returns false when the consumer
/// stopped. Batch line numbers count the lines of this pass.
fn read_batches(
    input: &mut dyn BufRead,
    path: &Path,
    order: LineOrder,
    pass: u64,
    mut send: impl FnMut(Result<Batch, DataError>) -> bool,
) {
    let mut index: u64 = 0;
    let mut kept: u64 = 0;
    let mut batch = Batch {
        first_line: 1,
        lines: Vec::new(),
    };
    let mut batch_bytes = 0;
    let mut buffer = Vec::new();
    loop {
        buffer.clear();
        match input.read_until(b'\n', &mut buffer) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => {
                send(Err(DataError::Io {
                    path: path.to_path_buf(),
                    source: e,
                }));
                return;
            }
        }
        let take = match order {
            LineOrder::InOrder => true,
            LineOrder::RoundRobin { count } => index % count == pass,
        };
        index += 1;
        if !take {
            continue;
        }
        kept += 1;
        if buffer.last() == Some(&b'\n') {
            buffer.pop();
        }
        // Invalid UTF-8 becomes an error naming the line, not a crash.
        let line = String::from_utf8(std::mem::take(&mut buffer))
            .map_err(|e| format!("invalid UTF-8 at byte {}", e.utf8_error().valid_up_to()));
        batch_bytes += line.as_ref().map_or(0, String::len);
        batch.lines.push(line);
        if batch.lines.len() >= BATCH_LINES || batch_bytes >= BATCH_BYTES {
            let next = Batch {
                first_line: kept + 1,
                lines: Vec::with_capacity(BATCH_LINES),
            };
            if !send(Ok(std::mem::replace(&mut batch, next))) {
                return;
            }
            batch_bytes = 0;
        }
    }
    if !batch.lines.is_empty() {
        send(Ok(batch));
    }
}

/// Megatron's `Encoder.encode` for one line: per key, the non-empty tokenized pieces
/// (a list value gives several sequences) and the `eod` on the last one.
fn encode_line(
    line: &str,
    keys: &[String],
    tokenizer: &dyn Tokenizer,
    eod: Option<u32>,
) -> Result<LineDocuments, String> {
    let value: serde_json::Value =
        serde_json::from_str(line).map_err(|e| format!("invalid JSON: {e}"))?;
    let object = value.as_object().ok_or("not a JSON object")?;
    keys.iter()
        .map(|key| {
            let text = object
                .get(key)
                .ok_or_else(|| format!("missing key {key:?}"))?;
            let pieces: Vec<&str> = match text {
                serde_json::Value::String(s) => vec![s.as_str()],
                serde_json::Value::Array(items) => items
                    .iter()
                    .map(|item| {
                        item.as_str()
                            .ok_or_else(|| format!("key {key:?}: a list item is not a string"))
                    })
                    .collect::<Result<_, _>>()?,
                _ => {
                    return Err(format!(
                        "key {key:?} is neither a string nor a list of strings"
                    ))
                }
            };
            let mut tokens = Vec::new();
            let mut lengths = Vec::new();
            for piece in pieces {
                let ids = tokenizer
                    .tokenize(piece)
                    .map_err(|e| format!("key {key:?}: {e}"))?;
                if !ids.is_empty() {
                    lengths.push(ids.len());
                    tokens.extend(ids);
                }
            }
            if let (Some(eod), Some(last)) = (eod, lengths.last_mut()) {
                tokens.push(eod);
                *last += 1;
            }
            Ok((tokens, lengths))
        })
        .collect()
}

/// The texts under `keys` of every line of a JSONL file (list values give one text per
/// item), for tokenizer training. A malformed line is an error naming it.
pub fn read_json_texts(path: &Path, keys: &[String]) -> Result<Vec<String>, PreprocessError> {
    let mut input = open_input(path)?;
    let mut texts = Vec::new();
    let mut line = String::new();
    for number in 1.. {
        line.clear();
        let read = input.read_line(&mut line).map_err(|e| match e.kind() {
            std::io::ErrorKind::InvalidData => PreprocessError::BadLine {
                path: path.to_path_buf(),
                line: number,
                reason: "invalid UTF-8".into(),
            },
            _ => PreprocessError::Data(DataError::Io {
                path: path.to_path_buf(),
                source: e,
            }),
        })?;
        if read == 0 {
            break;
        }
        let bad = |reason: String| PreprocessError::BadLine {
            path: path.to_path_buf(),
            line: number,
            reason,
        };
        let value: serde_json::Value =
            serde_json::from_str(&line).map_err(|e| bad(format!("invalid JSON: {e}")))?;
        for key in keys {
            match value.get(key) {
                Some(serde_json::Value::String(s)) => texts.push(s.clone()),
                Some(serde_json::Value::Array(items)) => {
                    for item in items {
                        texts.push(
                            item.as_str()
                                .ok_or_else(|| {
                                    bad(format!("key {key:?}: a list item is not a string"))
                                })?
                                .to_owned(),
                        );
                    }
                }
                Some(_) => {
                    return Err(bad(format!(
                        "key {key:?} is neither a string nor a list of strings"
                    )))
                }
                None => return Err(bad(format!("missing key {key:?}"))),
            }
        }
    }
    Ok(texts)
}

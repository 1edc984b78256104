//! What a run reports per iteration: Megatron's log line, one JSON object per line
//! (`--log-json`), and TensorBoard scalars (`--tensorboard-dir`).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// One rank's time in one iteration, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct RankTimes {
    /// Forward/backward/optimizer computation (with emulated slowdown).
    pub compute_ms: f64,
    /// Blocked in sends and collectives: the communication computation did not hide.
    pub communication_ms: f64,
    /// Of `communication_ms`, the wait for the data-parallel gradient reductions after
    /// the rank's pipeline had run (with `--overlap-grad-reduce`, what the backward did
    /// not hide of them).
    pub reduce_wait_ms: f64,
    /// Of `communication_ms`, the wait for the distributed optimizer's parameter
    /// all-gather: all of it after the optimizer, or with `--overlap-param-gather` what
    /// the forwards did not hide of it (0 without the distributed optimizer).
    pub param_gather_wait_ms: f64,
    /// Waiting for pipeline neighbours and everything else (data, bookkeeping).
    pub idle_ms: f64,
    /// Tokens of this rank's replica per second of the step (every stage of a replica
    /// processes the same tokens).
    pub tokens_per_s: f64,
    /// Bytes of its parameters, gradients, fp32 main gradients and optimizer state.
    pub state_bytes: u64,
    /// Its activation high-water mark in bytes (see [`crate::memory`]), once measured.
    pub activation_peak_bytes: Option<u64>,
    /// What it did when, seconds from the step's start (on the iterations whose log
    /// line is printed; `synerfuse timeline` draws them).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spans: Option<Vec<synerfuse_plan::timeline::Span>>,
    /// Bytes it sent over emulated links between two nodes of one site in the step
    /// (where the plan's network is emulated).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_across_nodes: Option<u64>,
    /// Bytes it sent over emulated links between two sites in the step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub bytes_across_sites: Option<u64>,
}

/// One iteration's numbers, as the log line and the JSON log carry them.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct IterationRecord {
    /// Iterations completed (1 after the first).
    pub iteration: u64,
    /// `--train-iters`.
    pub train_iters: u64,
    /// Samples consumed after this iteration.
    pub consumed_samples: u64,
    /// Learning rate used by this iteration's update.
    pub lr: f64,
    /// Mean loss over the global batch's loss tokens.
    pub loss: f64,
    /// Global gradient norm before clipping (unscaled; not finite, `null`, on an
    /// iteration skipped for an overflow).
    pub grad_norm: f64,
    /// The loss scale after the iteration's update, as Megatron logs it (1 unless the
    /// loss is scaled: fp16, `--loss-scale`).
    pub loss_scale: f64,
    /// Whether its gradients overflowed, so that it made no update (no optimizer or
    /// learning-rate step; the iteration still counts).
    pub skipped: bool,
    /// Iterations skipped since the last log line, this one included (Megatron's
    /// "number of skipped iterations").
    pub skipped_iterations: u64,
    /// Iterations since the last log line whose loss was not finite.
    pub nan_iterations: u64,
    /// Wall time of the iteration.
    pub elapsed_ms: f64,
    /// Tokens of the global batch per second.
    pub tokens_per_s: f64,
    /// Model TFLOP/s per rank, by Megatron's FLOP count
    /// ([`synerfuse_plan::ModelShape::megatron_flops_per_sample`]).
    pub tflops_per_device: f64,
    /// `--global-batch-size`.
    pub global_batch_size: usize,
    /// A mixture of experts' load balance over the step (none for a dense model).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub moe: Option<crate::expert_load::ExpertStep>,
    /// Per rank, by world rank.
    pub ranks: Vec<RankTimes>,
}

impl IterationRecord {
    /// Megatron's training log line (with tokens/s appended); with `throughput`
    /// (`--log-throughput`) Megatron's "throughput per GPU (TFLOP/s/GPU)" field too.
    pub fn log_line(&self, throughput: bool) -> String {
        let throughput = match throughput {
            true => format!(
                " throughput per GPU (TFLOP/s/GPU): {:.1} |",
                self.tflops_per_device
            ),
            false => String::new(),
        };
        // Megatron leaves the norm out of a skipped iteration's line (it has none).
        let grad_norm = match self.skipped {
            true => String::new(),
            false => format!(" grad norm: {:.3} |", self.grad_norm),
        };
        // Megatron's MoE runs add the means over the MoE layers of the losses taken
        // after the loss, the z-loss first, as its router tracks it first.
        let balance: String = (self.moe.iter())
            .flat_map(|moe| {
                [
                    ("z_loss", moe.mean_z_loss()),
                    ("load_balancing_loss", moe.mean_loss()),
                ]
            })
            .filter_map(|(name, mean)| Some(format!(" {name}: {} |", python_exp(mean?))))
            .collect();
        format!(
            " iteration {:>8}/{:>8} | consumed samples: {:>12} | elapsed time per iteration (ms): {:.1} |{throughput} \
             learning rate: {} | global batch size: {:>5} | \
             lm loss: {} |{balance} loss scale: {:.1} |{grad_norm} number of skipped iterations: {:>3} | \
             number of nan iterations: {:>3} | tokens/s: {:.0} |",
            self.iteration,
            self.train_iters,
            self.consumed_samples,
            self.elapsed_ms,
            python_exp(self.lr),
            self.global_batch_size,
            python_exp(self.loss),
            self.loss_scale,
            self.skipped_iterations,
            self.nan_iterations,
            self.tokens_per_s,
        )
    }
}

/// `value` as Python's `'{:.6E}'.format(value)` (Megatron's log format): `3.000000E-04`.
pub(crate) fn python_exp(value: f64) -> String {
    if !value.is_finite() {
        return format!("{value}");
    }
    let text = format!("{value:.6E}");
    let (mantissa, exponent) = text.split_once('E').expect("exponent");
    let exponent: i32 = exponent.parse().expect("integer exponent");
    let sign = if exponent < 0 { '-' } else { '+' };
    format!("{mantissa}E{sign}{:02}", exponent.abs())
}

/// `--log-json FILE`: one JSON object per line and iteration (and one per evaluation,
/// which has an `evaluation` field), flushed after each line so a killed run keeps what
/// it logged.
pub struct JsonLog {
    path: PathBuf,
    out: BufWriter<File>,
}

impl JsonLog {
    /// Appends to `path` (a resumed run continues the same file).
    pub fn open(path: &Path) -> std::io::Result<Self> {
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty()) {
            std::fs::create_dir_all(parent)?;
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)?;
        Ok(Self {
            path: path.to_path_buf(),
            out: BufWriter::new(file),
        })
    }

    /// Writes one record (an [`IterationRecord`], or an evaluation's).
    pub fn write<T: serde::Serialize>(&mut self, record: &T) -> std::io::Result<()> {
        let line = serde_json::to_string(record).expect("record serialises");
        writeln!(self.out, "{line}")?;
        self.out.flush()
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

/// `--tensorboard-dir`: an `events.out.tfevents.*` file of scalar summaries, in
/// TensorBoard's TFRecord framing (length, masked CRC-32C, event proto, masked CRC-32C).
pub struct TensorBoardWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl TensorBoardWriter {
    /// A new event file in `dir`.
    pub fn create(dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "localhost".into());
        let path = dir.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            now.as_secs(),
            std::process::id()
        ));
        let mut writer = Self {
            out: BufWriter::new(File::create(&path)?),
            path,
        };
        // The first event names the file format.
        let mut event = Vec::new();
        proto_double(&mut event, 1, now.as_secs_f64());
        proto_bytes(&mut event, 3, b"brain.Event:2");
        writer.record(&event)?;
        writer.out.flush()?;
        Ok(writer)
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Scalars `(tag, value)` at `step`.
    pub fn scalars(&mut self, step: u64, values: &[(&str, f64)]) -> std::io::Result<()> {
        let wall = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs_f64();
        let mut summary = Vec::new();
        for (tag, value) in values {
            let mut v = Vec::new();
            proto_bytes(&mut v, 1, tag.as_bytes());
            // simple_value: field 2, fixed32 float.
            v.push((2 << 3) | 5);
            v.extend_from_slice(&(*value as f32).to_le_bytes());
            proto_bytes(&mut summary, 1, &v);
        }
        let mut event = Vec::new();
        proto_double(&mut event, 1, wall);
        proto_varint_field(&mut event, 2, step);
        proto_bytes(&mut event, 5, &summary);
        self.record(&event)?;
        self.out.flush()
    }

    fn record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        self.out.write_all(&len)?;
        self.out.write_all(&masked_crc32c(&len).to_le_bytes())?;
        self.out.write_all(data)?;
        self.out.write_all(&masked_crc32c(data).to_le_bytes())
    }
}

fn proto_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn proto_varint_field(out: &mut Vec<u8>, field: u64, value: u64) {
    proto_varint(out, field << 3);
    proto_varint(out, value);
}

fn proto_double(out: &mut Vec<u8>, field: u64, value: f64) {
    proto_varint(out, (field << 3) | 1);
    out.extend_from_slice(&value.to_le_bytes());
}

fn proto_bytes(out: &mut Vec<u8>, field: u64, bytes: &[u8]) {
    proto_varint(out, (field << 3) | 2);
    proto_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// CRC-32C (Castagnoli), bitwise: event files are small.
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &byte in data {
        crc ^= u32::from(byte);
        for _ in 0..8 {
            crc = if crc & 1 != 0 {
                (crc >> 1) ^ 0x82f6_3b78
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// TFRecord's masked CRC.
fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c(data);
    (crc.rotate_right(15)).wrapping_add(0xa282_ead8)
}

/// Reads back the `(step, tag, value)` scalars of an event file, checking every CRC
/// (for tests and tools).
pub fn read_scalars(path: &Path) -> std::io::Result<Vec<(u64, String, f32)>> {
    let bytes = std::fs::read(path)?;
    let bad = |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_owned());
    let mut out = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let header = bytes
            .get(at..at + 12)
            .ok_or_else(|| bad("truncated header"))?;
        let len = u64::from_le_bytes(header[..8].try_into().expect("8 bytes")) as usize;
        if masked_crc32c(&header[..8]).to_le_bytes() != header[8..12] {
            return Err(bad("length CRC mismatch"));
        }
        let data = bytes
            .get(at + 12..at + 12 + len)
            .ok_or_else(|| bad("truncated record"))?;
        let crc = bytes
            .get(at + 12 + len..at + 16 + len)
            .ok_or_else(|| bad("truncated CRC"))?;
        if masked_crc32c(data).to_le_bytes() != crc {
            return Err(bad("data CRC mismatch"));
        }
        let event = parse_fields(data).ok_or_else(|| bad("bad event proto"))?;
        let step = event
            .iter()
            .find(|f| f.0 == 2)
            .map_or(0, |f| f.1.varint_value());
        for summary in event.iter().filter(|f| f.0 == 5) {
            let values = parse_fields(summary.1.bytes()).ok_or_else(|| bad("bad summary"))?;
            for value in values.iter().filter(|f| f.0 == 1) {
                let fields = parse_fields(value.1.bytes()).ok_or_else(|| bad("bad value"))?;
                let tag = fields.iter().find(|f| f.0 == 1).map(|f| f.1.bytes());
                let simple = fields.iter().find(|f| f.0 == 2).map(|f| f.1.bytes());
                if let (Some(tag), Some(simple)) = (tag, simple) {
                    let v = f32::from_le_bytes(simple.try_into().map_err(|_| bad("bad float"))?);
                    out.push((step, String::from_utf8_lossy(tag).into_owned(), v));
                }
            }
        }
        at += 16 + len;
    }
    Ok(out)
}

enum Field<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
}

impl Field<'_> {
    fn varint_value(&self) -> u64 {
        match self {
            Field::Varint(v) => *v,
            Field::Bytes(_) => 0,
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            Field::Bytes(b) => b,
            Field::Varint(_) => &[],
        }
    }
}

fn parse_fields(mut data: &[u8]) -> Option<Vec<(u64, Field<'_>)>> {
    fn varint(data: &mut &[u8]) -> Option<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let (&b, rest) = data.split_first()?;
            *data = rest;
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Some(value);
            }
        }
        None
    }
    let mut out = Vec::new();
    while !data.is_empty() {
        let key = varint(&mut data)?;
        let field = match key & 7 {
            0 => Field::Varint(varint(&mut data)?),
            1 => {
                let (b, rest) = data.split_at_checked(8)?;
                data = rest;
                Field::Bytes(b)
            }
            2 => {
                let len = varint(&mut data)? as usize;
                let (b, rest) = data.split_at_checked(len)?;
                data = rest;
                Field::Bytes(b)
            }
            5 => {
                let (b, rest) = data.split_at_checked(4)?;
                data = rest;
                Field::Bytes(b)
            }
            _ => return None,
        };
        out.push((key >> 3, field));
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_check_value() {
        // The CRC-32C check value of "123456789".
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn event_file_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let mut tb = TensorBoardWriter::create(dir.path()).unwrap();
        tb.scalars(1, &[("lm-loss", 5.5), ("learning-rate", 1e-4)])
            .unwrap();
        tb.scalars(2, &[("lm-loss", 4.25)]).unwrap();
        let got = read_scalars(tb.path()).unwrap();
        assert_eq!(
            got,
            vec![
                (1, "lm-loss".to_owned(), 5.5),
                (1, "learning-rate".to_owned(), 1e-4),
                (2, "lm-loss".to_owned(), 4.25)
            ]
        );
        // A flipped byte is caught.
        let mut bytes = std::fs::read(tb.path()).unwrap();
        let n = bytes.len();
        bytes[n - 6] ^= 1;
        std::fs::write(tb.path(), bytes).unwrap();
        assert!(read_scalars(tb.path()).is_err());
    }

    #[test]
    fn log_line_reads_like_megatron() {
        let record = IterationRecord {
            iteration: 10,
            train_iters: 200,
            consumed_samples: 80,
            lr: 3e-4,
            loss: 7.25,
            grad_norm: 1.5,
            loss_scale: 1.0,
            skipped: false,
            skipped_iterations: 0,
            nan_iterations: 0,
            elapsed_ms: 123.4,
            tokens_per_s: 4000.0,
            tflops_per_device: 0.01,
            global_batch_size: 8,
            moe: None,
            ranks: vec![],
        };
        let line = record.log_line(false);
        assert!(line.contains("iteration       10/     200 |"), "{line}");
        assert!(!line.contains("throughput"), "{line}");
        let with = record.log_line(true);
        assert!(
            with.contains(
                "elapsed time per iteration (ms): 123.4 | throughput per GPU (TFLOP/s/GPU): 0.0 | learning rate:"
            ),
            "{with}"
        );
        assert!(line.contains("lm loss: 7.250000E+00 |"), "{line}");
        assert!(line.contains("learning rate: 3.000000E-04 |"), "{line}");
        let moe = IterationRecord {
            moe: Some(crate::expert_load::ExpertStep {
                layers: vec![0, 1],
                load_balancing_loss: Some(vec![1.0, 1.5]),
                z_loss: None,
                tokens_per_expert: vec![vec![3.0, 5.0], vec![4.0, 4.0]],
            }),
            ..record.clone()
        };
        let line = moe.log_line(false);
        assert!(
            line.contains("lm loss: 7.250000E+00 | load_balancing_loss: 1.250000E+00 | loss scale"),
            "{line}"
        );
        let mut z = moe.clone();
        z.moe.as_mut().unwrap().z_loss = Some(vec![2.0, 3.0]);
        let line = z.log_line(false);
        assert!(
            line.contains("lm loss: 7.250000E+00 | z_loss: 2.500000E+00 | load_balancing_loss: 1.250000E+00 |"),
            "{line}"
        );
        z.moe.as_mut().unwrap().load_balancing_loss = None;
        let line = z.log_line(false);
        assert!(
            line.contains("lm loss: 7.250000E+00 | z_loss: 2.500000E+00 | loss scale"),
            "{line}"
        );
        // fp16: the scale, and a skipped iteration without its norm.
        let skipped = IterationRecord {
            loss_scale: 4294967296.0,
            skipped: true,
            skipped_iterations: 3,
            grad_norm: f64::INFINITY,
            ..record.clone()
        };
        let line = skipped.log_line(false);
        assert!(
            line.contains(
                "lm loss: 7.250000E+00 | loss scale: 4294967296.0 | number of skipped iterations:   3 | number of nan iterations:   0 |"
            ),
            "{line}"
        );
        let line = record.log_line(false);
        assert!(
            line.contains(
                "loss scale: 1.0 | grad norm: 1.500 | number of skipped iterations:   0 |"
            ),
            "{line}"
        );
        assert_eq!(python_exp(0.0), "0.000000E+00");
        assert_eq!(python_exp(123456.0), "1.234560E+05");
    }
}

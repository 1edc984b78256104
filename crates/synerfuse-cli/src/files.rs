//! Writing the files the commands produce.

use anyhow::{Context, Result};

/// Writes `text` to `path` under a temporary name first, so that a file that looks
/// complete is complete.
pub fn write_atomically(path: &std::path::Path, text: &str) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}

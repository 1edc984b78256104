//! Compiles the SentencePiece id-encoder shim (`src/tokenizer/spm_ids.cpp`) against the
//! header of the `sentencepiece-sys` source that builds the library (pinned version).
//!
//! Cargo gives no dependency's source path to a build script, so the header is looked
//! up where cargo unpacks crates (`$CARGO_HOME/registry/src/*/`), next to this crate
//! (registry or vendor directory), or in `SENTENCEPIECE_INCLUDE`. Without it the crate
//! still works, through the library's slower serialized encoder, and says so.

#[cfg(feature = "tokenizers")]
use std::path::{Path, PathBuf};

#[cfg(feature = "tokenizers")]
const SYS_CRATE: &str = "sentencepiece-sys-0.14.0";
#[cfg(feature = "tokenizers")]
const HEADER: &str = "sentencepiece_processor.h";

#[cfg(feature = "tokenizers")]
fn find_include_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("SENTENCEPIECE_INCLUDE").map(PathBuf::from) {
        return dir.join(HEADER).is_file().then_some(dir);
    }
    let in_source = |root: &Path| {
        Some(root.join(SYS_CRATE).join("source/src")).filter(|d| d.join(HEADER).is_file())
    };
    let manifest_dir = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR")?);
    if let Some(dir) = manifest_dir.parent().and_then(in_source) {
        return Some(dir);
    }
    let cargo_home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cargo")))?;
    let registries = std::fs::read_dir(cargo_home.join("registry/src")).ok()?;
    let mut found: Vec<PathBuf> = registries
        .filter_map(|r| in_source(&r.ok()?.path()))
        .collect();
    found.sort();
    found.into_iter().next()
}

fn main() {
    println!("cargo:rustc-check-cfg=cfg(synerfuse_spm_ids)");
    #[cfg(feature = "tokenizers")]
    build_spm_shim();
}

/// The SentencePiece id-encoder shim (the `tokenizers` feature only).
#[cfg(feature = "tokenizers")]
fn build_spm_shim() {
    println!("cargo:rerun-if-changed=src/tokenizer/spm_ids.cpp");
    println!("cargo:rerun-if-env-changed=SENTENCEPIECE_INCLUDE");
    match find_include_dir() {
        Some(include) => {
            cc::Build::new()
                .cpp(true)
                .file("src/tokenizer/spm_ids.cpp")
                .include(&include)
                .flag("-std=c++17")
                .warnings(false)
                .compile("synerfuse_spm_ids");
            println!("cargo:rustc-cfg=synerfuse_spm_ids");
        }
        None => println!(
            "cargo:warning=synerfuse-data: {HEADER} of {SYS_CRATE} not found (set SENTENCEPIECE_INCLUDE); \
             SentencePiece tokenizers use the library's slower serialized encoder"
        ),
    }
}

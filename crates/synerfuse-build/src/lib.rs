//! The build-script step every synerfuse package that links libtorch runs.
//!
//! It records libtorch's library directory (found by torch-sys) as an rpath of the
//! package's binaries and tests, so they run without `LD_LIBRARY_PATH`. The wheel's NCCL
//! directory is added too: NCCL is dlopen'ed by name, which searches the executable's
//! rpath.
//!
//! When this libtorch ships `libtorch_cuda.so`, it is linked with `--no-as-needed`:
//! nothing references its symbols, so the default `--as-needed` would drop it, and
//! without it libtorch registers no CUDA backend (check with `readelf -d`).
#![warn(missing_docs)]

use std::path::Path;

/// Prints the link arguments for libtorch of the package being built. Call it from the
/// `build.rs` of a package that depends on `torch-sys` (directly, so that Cargo passes
/// it `DEP_TCH_LIBTORCH_LIB`); without that variable it does nothing.
pub fn link_libtorch() {
    let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        return;
    };
    for line in link_lines(Path::new(&dir)) {
        println!("{line}");
    }
}

/// The `cargo:` lines for a libtorch in `lib`.
pub fn link_lines(lib: &Path) -> Vec<String> {
    let mut lines = vec![
        format!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display()),
        format!("cargo:rustc-env=SYNERFUSE_LIBTORCH_LIB={}", lib.display()),
    ];
    if lib.join("libtorch_cuda.so").is_file() {
        lines.push("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed".into());
    }
    let nccl = lib.join("../../nvidia/nccl/lib");
    if nccl.is_dir() {
        lines.push(format!(
            "cargo:rustc-link-arg=-Wl,-rpath,{}",
            nccl.display()
        ));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_is_linked_only_when_the_libtorch_has_it() {
        let dir = std::env::temp_dir().join(format!("synerfuse-build-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let without = link_lines(&dir);
        assert_eq!(without.len(), 2);
        assert!(without[0].ends_with(&format!("-rpath,{}", dir.display())));
        std::fs::write(dir.join("libtorch_cuda.so"), b"").unwrap();
        let with = link_lines(&dir);
        assert!(with
            .iter()
            .any(|l| l.contains("--no-as-needed,-ltorch_cuda")));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

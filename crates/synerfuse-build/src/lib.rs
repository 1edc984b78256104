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

/// Prints the link arguments for libtorch of the package being built, for all its
/// binaries and tests. Call it from the `build.rs` of a package that depends on
/// `torch-sys` (directly, so that Cargo passes it `DEP_TCH_LIBTORCH_LIB`); without that
/// variable it does nothing.
pub fn link_libtorch() {
    print_link_lines(&["rustc-link-arg"]);
}

/// As [`link_libtorch`], for the binary `bin` and the package's tests only: the
/// package's other binaries stay free of libtorch (`--no-as-needed` would otherwise load
/// libtorch_cuda into them, ~0.35 s and 0.5 GB before `main`).
pub fn link_libtorch_into(bin: &str) {
    print_link_lines(&[&format!("rustc-link-arg-bin={bin}"), "rustc-link-arg-tests"]);
}

fn print_link_lines(directives: &[&str]) {
    let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        return;
    };
    let lib = Path::new(&dir);
    println!("cargo:rustc-env=SYNERFUSE_LIBTORCH_LIB={}", lib.display());
    for directive in directives {
        for arg in link_args(lib) {
            println!("cargo:{directive}={arg}");
        }
    }
}

/// Compiles the C++ files `sources` (paths relative to the package) against the headers
/// of the libtorch torch-sys found, into the static library `name` linked into the
/// package: how a crate reaches a libtorch operator tch does not bind (torch-sys builds
/// its own bindings the same way). The C++ ABI follows torch-sys's: `LIBTORCH_CXX11_ABI`,
/// else 1 (the PyPI wheels' since PyTorch 2.7). Without `DEP_TCH_LIBTORCH_LIB` it does
/// nothing.
pub fn compile_against_libtorch(name: &str, sources: &[&str]) {
    let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        return;
    };
    let include = Path::new(&dir).join("../include");
    // `synerfuse_shim.h`: the error handling every shim shares.
    let shared = Path::new(env!("CARGO_MANIFEST_DIR")).join("include");
    println!(
        "cargo:rerun-if-changed={}",
        shared.join("synerfuse_shim.h").display()
    );
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_owned());
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    for source in sources {
        println!("cargo:rerun-if-changed={source}");
    }
    cc::Build::new()
        .cpp(true)
        .pic(true)
        .warnings(false)
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .include(&shared)
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .files(sources)
        .compile(name);
}

/// The linker arguments for a libtorch in `lib`.
pub fn link_args(lib: &Path) -> Vec<String> {
    let mut args = vec![format!("-Wl,-rpath,{}", lib.display())];
    if lib.join("libtorch_cuda.so").is_file() {
        args.push("-Wl,--no-as-needed,-ltorch_cuda,--as-needed".into());
    }
    let nccl = lib.join("../../nvidia/nccl/lib");
    if nccl.is_dir() {
        args.push(format!("-Wl,-rpath,{}", nccl.display()));
    }
    args
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_is_linked_only_when_the_libtorch_has_it() {
        let dir = std::env::temp_dir().join(format!("synerfuse-build-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let without = link_args(&dir);
        assert_eq!(without, [format!("-Wl,-rpath,{}", dir.display())]);
        std::fs::write(dir.join("libtorch_cuda.so"), b"").unwrap();
        let with = link_args(&dir);
        assert!(with
            .iter()
            .any(|l| l.contains("--no-as-needed,-ltorch_cuda")));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

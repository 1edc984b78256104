//! Records libtorch's library directory (found by torch-sys) as an rpath of this
//! package's binaries and tests, so they run without LD_LIBRARY_PATH. The wheel's NCCL
//! directory is added too: NCCL is dlopen'ed by name, which searches the executable's
//! rpath.
//!
//! When this libtorch ships `libtorch_cuda.so`, it is linked with `--no-as-needed`:
//! nothing references its symbols, so the default `--as-needed` would drop it, and
//! without it libtorch registers no CUDA backend (check with `readelf -d`).
fn main() {
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        println!("cargo:rustc-env=SYNERFUSE_LIBTORCH_LIB={dir}");
        let lib = std::path::Path::new(&dir);
        if lib.join("libtorch_cuda.so").is_file() {
            println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
        }
        let nccl = lib.join("../../nvidia/nccl/lib");
        if nccl.is_dir() {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", nccl.display());
        }
    }
}

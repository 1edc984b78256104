//! Records libtorch's library directory (found by torch-sys) as an rpath of this
//! package's binaries and tests, so they run without LD_LIBRARY_PATH. The wheel's NCCL
//! directory is added too: NCCL is dlopen'ed by name, which searches the executable's
//! rpath.
fn main() {
    if let Ok(dir) = std::env::var("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
        println!("cargo:rustc-env=SYNERFUSE_LIBTORCH_LIB={dir}");
        let nccl = std::path::Path::new(&dir).join("../../nvidia/nccl/lib");
        if nccl.is_dir() {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{}", nccl.display());
        }
    }
}

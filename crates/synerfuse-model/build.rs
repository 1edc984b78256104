//! libtorch's rpath, its CUDA library kept linked, and the C++ shim for what tch does not
//! bind (`csrc/`: custom autograd functions): see `synerfuse-build`.
fn main() {
    synerfuse_build::link_libtorch();
    synerfuse_build::compile_against_libtorch(
        "synerfuse_model_shim",
        &[
            "csrc/shim.cpp",
            "csrc/joined_linear.cpp",
            "csrc/swiglu.cpp",
            "csrc/rope.cpp",
        ],
    );
}

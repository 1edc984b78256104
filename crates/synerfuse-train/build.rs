//! libtorch's rpath, its CUDA library kept linked, and the C++ shim for the libtorch
//! operators tch does not bind (`csrc/`): see `synerfuse-build`.
fn main() {
    synerfuse_build::link_libtorch();
    synerfuse_build::compile_against_libtorch("synerfuse_shim", &["csrc/fused_adamw.cpp"]);
}

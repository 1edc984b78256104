//! libtorch's rpath, and its CUDA library kept linked: see `synerfuse-build`.
fn main() {
    synerfuse_build::link_libtorch();
}

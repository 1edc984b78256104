//! libtorch's rpath, and its CUDA library kept linked, for `synerfuse-torch` and the tests
//! only: `synerfuse` itself stays free of libtorch. See `synerfuse-build`.
fn main() {
    synerfuse_build::link_libtorch_into("synerfuse-torch");
}

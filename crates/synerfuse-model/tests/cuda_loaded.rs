//! A binary built against a libtorch that ships `libtorch_cuda.so` loads it
//! at start-up (linked with `--no-as-needed`), before anything asks for a device; without
//! it libtorch registers no CUDA backend and a GPU node would silently train on the CPU.
//! Its own test binary, so no other test's device query can load it first.

use synerfuse_model::cuda::{self, CudaSupport, LIBTORCH_CUDA};

#[test]
fn libtorch_cuda_is_loaded_at_start_up_when_libtorch_has_it() {
    let dir = cuda::libtorch_lib_dir().expect("built against a known libtorch");
    let shipped = dir.join(LIBTORCH_CUDA).is_file();
    let mapped = cuda::mapped_library();
    if shipped {
        let path = mapped.unwrap_or_else(|| {
            panic!(
                "{} is in {} but not mapped into this test executable",
                LIBTORCH_CUDA,
                dir.display()
            )
        });
        assert!(path.ends_with(LIBTORCH_CUDA), "{}", path.display());
        assert!(matches!(cuda::ensure_loaded(), CudaSupport::Loaded(_)));
    } else {
        assert_eq!(mapped, None);
        assert_eq!(cuda::ensure_loaded(), &CudaSupport::NotInLibtorch);
        assert_eq!(cuda::visible_gpus(), 0);
    }
}

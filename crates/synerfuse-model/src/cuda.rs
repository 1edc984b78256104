//! libtorch's CUDA backend: whether this process has it, and loading it when it does not.
//!
//! libtorch registers its CUDA backend from the static initialisers of
//! `libtorch_cuda.so`. Nothing in a Rust binary references that library's symbols, so a
//! linker run with `--as-needed` drops it and the process silently computes on the CPU.
//! This workspace's executables link it with `--no-as-needed` (their build scripts);
//! [`ensure_loaded`] opens it at run time for any other executable, before the first
//! device query.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The library whose initialisers register libtorch's CUDA backend.
pub const LIBTORCH_CUDA: &str = "libtorch_cuda.so";

/// libtorch's CUDA support in this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaSupport {
    /// `libtorch_cuda.so` is mapped into this process (from this path).
    Loaded(PathBuf),
    /// The libtorch this binary was built against has no CUDA library (a CPU build).
    NotInLibtorch,
    /// The library is there but could not be opened (a missing CUDA runtime library).
    LoadFailed {
        /// The library.
        path: PathBuf,
        /// `dlerror`'s message.
        error: String,
    },
}

impl std::fmt::Display for CudaSupport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Loaded(path) => write!(f, "loaded ({})", path.display()),
            Self::NotInLibtorch => f.write_str("not in this libtorch"),
            Self::LoadFailed { path, error } => {
                write!(f, "present but not loadable ({}: {error})", path.display())
            }
        }
    }
}

/// The libtorch library directory this crate was built against, if known.
pub fn libtorch_lib_dir() -> Option<&'static Path> {
    option_env!("SYNERFUSE_LIBTORCH_LIB").map(Path::new)
}

/// The path of `libtorch_cuda.so` when it is mapped into this process.
pub fn mapped_library() -> Option<PathBuf> {
    mapped("libtorch_cuda.so")
}

/// The path of the shared library `file_name` when it is mapped into this process.
fn mapped(file_name: &str) -> Option<PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|line| line.split_whitespace().nth(5))
        .find(|path| Path::new(path).file_name() == Some(file_name.as_ref()))
        .map(PathBuf::from)
}

/// The libtorch this process runs on: where its `libtorch_cpu.so` was loaded from (which
/// need not be the one it was built against: `LD_LIBRARY_PATH` may name another) and its
/// version, read from the torch wheel's `version.py` or a libtorch archive's
/// `build-version` beside that directory.
pub fn loaded_libtorch() -> Option<(PathBuf, Option<String>)> {
    let lib = mapped("libtorch_cpu.so")?;
    let dir = lib.parent()?.to_path_buf();
    let version = std::fs::read_to_string(dir.join("../version.py"))
        .ok()
        .and_then(|text| {
            text.lines().find_map(|l| {
                l.strip_prefix("__version__ = ")
                    .map(|v| v.trim().trim_matches(['\'', '"']).to_owned())
            })
        })
        .or_else(|| {
            std::fs::read_to_string(dir.join("../build-version"))
                .ok()
                .map(|v| v.trim().to_owned())
        });
    Some((dir, version))
}

/// Makes sure libtorch's CUDA backend is registered when this libtorch has one: opens
/// `libtorch_cuda.so` (once per process) unless it is already mapped. Call it before the
/// first CUDA query; [`crate::ResolveDevice::resolve`] does.
pub fn ensure_loaded() -> &'static CudaSupport {
    static SUPPORT: OnceLock<CudaSupport> = OnceLock::new();
    SUPPORT.get_or_init(|| {
        if let Some(path) = mapped_library() {
            return CudaSupport::Loaded(path);
        }
        let Some(path) = libtorch_lib_dir()
            .map(|dir| dir.join(LIBTORCH_CUDA))
            .filter(|p| p.is_file())
        else {
            return CudaSupport::NotInLibtorch;
        };
        match open_global(&path) {
            Ok(()) => CudaSupport::Loaded(path),
            Err(error) => CudaSupport::LoadFailed { path, error },
        }
    })
}

/// Number of GPUs libtorch can use (0 without CUDA support or without a GPU).
pub fn visible_gpus() -> usize {
    if !matches!(ensure_loaded(), CudaSupport::Loaded(_)) {
        return 0;
    }
    if tch::Cuda::is_available() {
        tch::Cuda::device_count().max(0) as usize
    } else {
        0
    }
}

fn open_global(path: &Path) -> Result<(), String> {
    use std::os::unix::ffi::OsStrExt;
    let name = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: `name` is a valid C string; the handle is kept open for the process's life
    // (libtorch's registries point into the library).
    let handle = unsafe { libc::dlopen(name.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if handle.is_null() {
        // SAFETY: dlerror returns a thread-local C string or null.
        let message = unsafe { libc::dlerror() };
        return Err(if message.is_null() {
            "dlopen failed".to_owned()
        } else {
            // SAFETY: non-null dlerror strings are valid C strings.
            unsafe { std::ffi::CStr::from_ptr(message) }
                .to_string_lossy()
                .into_owned()
        });
    }
    Ok(())
}

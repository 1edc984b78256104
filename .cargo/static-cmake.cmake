# Read by the `cmake` crate for every CMake build in this workspace (CMAKE_TOOLCHAIN_FILE in
# .cargo/config.toml): only the vendored sentencepiece uses CMake, and its crate links the
# static libraries, so its shared ones (every source compiled a second time) are not built.
set(SPM_ENABLE_SHARED OFF CACHE BOOL "sentencepiece: static libraries only" FORCE)

//! `cargo xtask gpu-bundle`: everything a borrowed GPU machine needs to run synerfuse's
//! GPU check, in `target/gpu-bundle/` (at most [`MAX_BUNDLE_BYTES`]; with `--debug`, of the
//! debug binaries, in `target/gpu-bundle-debug/`, to be checked here only).
//!
//! The GPU machines carry PyTorch 2.11 (libtorch, NCCL) but no Rust, no MPI we can count
//! on and no network, and at most 64 MiB of files travel there. So the bundle holds:
//! - `bin/`: the release binaries, stripped, with no rpath: they find libtorch and NCCL in
//!   the PyTorch that `python3` imports, through `LD_LIBRARY_PATH` set by `check.sh`;
//! - `mpi/`: the OpenMPI runtime they link (libraries, `mpirun`/`orted`, the MCA and PMIx
//!   components a single-node run uses, help files), relocated by `OPAL_*` variables;
//! - `data/`: a small tokenized corpus and its tokenizer;
//! - `check.sh` and `check/` (the reference training loop, the report writer).

use anyhow::{bail, ensure, Context, Result};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The bundle must leave room in the 64 MiB that travels with the working tree.
pub const MAX_BUNDLE_BYTES: u64 = 48 * 1024 * 1024;

/// Libraries every Linux machine has (glibc, the C++ runtime PyTorch itself needs):
/// never copied, so the GPU machine's own are used.
const SYSTEM_LIBS: &[&str] = &[
    "linux-vdso",
    "ld-linux-x86-64",
    "libc.so",
    "libm.so",
    "libdl.so",
    "libpthread.so",
    "librt.so",
    "libresolv.so",
    "libutil.so",
    "libstdc++.so",
    "libgcc_s.so",
];

/// MCA components whose libraries drive fabrics a single GPU machine has not got
/// (UCX, libfabric, verbs, PSM, Java): left out, with all they would pull in.
const SKIPPED_COMPONENT_DEPS: &[&str] = &[
    "libucp",
    "libucs",
    "libuct",
    "libucm",
    "libfabric",
    "libibverbs",
    "librdmacm",
    "libpsm",
    "libjvm",
    "libcuda",
];

/// What the OpenMPI of this machine is made of (Debian's layout).
struct MpiSource {
    orterun: PathBuf,
    orted: PathBuf,
    components: PathBuf,
    pmix_components: Option<PathBuf>,
    help: PathBuf,
    pmix_help: Option<PathBuf>,
}

impl MpiSource {
    fn find() -> Result<MpiSource> {
        let orterun = which("orterun").or_else(|| which("mpirun"));
        let Some(orterun) = orterun else {
            bail!("no mpirun on PATH: run `cargo xtask setup` (OpenMPI) first");
        };
        let orterun = std::fs::canonicalize(&orterun)?;
        let orted = orterun.with_file_name("orted");
        let arch = Path::new("/usr/lib/x86_64-linux-gnu");
        let components = arch.join("openmpi/lib/openmpi3");
        let help = PathBuf::from("/usr/share/openmpi");
        for needed in [&orted, &components, &help] {
            ensure!(
                needed.exists(),
                "{} is missing: the bundle copies Debian's OpenMPI 4 layout (openmpi-bin, libopenmpi3)",
                needed.display()
            );
        }
        let pmix = arch.join("pmix2/lib/pmix");
        let pmix_help = arch.join("pmix2/share/pmix");
        Ok(MpiSource {
            orterun,
            orted,
            components,
            pmix_components: pmix.is_dir().then_some(pmix),
            help,
            pmix_help: pmix_help.is_dir().then_some(pmix_help),
        })
    }
}

/// Builds the bundle (release binaries, or the debug ones with `debug`); its directory.
pub fn run(root: &Path, debug: bool) -> Result<PathBuf> {
    let started = std::time::Instant::now();
    let mut build = Command::new("cargo");
    // The debug bundle takes the binaries the workspace's tests built and ran (features
    // unified over the workspace): `cargo build -p synerfuse-cli` alone resolves other
    // features for some dependencies and rebuilt them, minutes of CI.
    match debug {
        true => build.args(["test", "--quiet", "--workspace", "--no-run"]),
        false => build.args(["build", "--quiet", "--release", "-p", "synerfuse-cli"]),
    };
    let status = build.current_dir(root).status()?;
    ensure!(status.success(), "building synerfuse-cli's binaries failed");
    let profile = if debug { "debug" } else { "release" };
    // A debug bundle goes beside the release one, which is the one that travels.
    let out = root.join(match debug {
        true => "target/gpu-bundle-debug",
        false => "target/gpu-bundle",
    });
    let tmp = out.with_extension("tmp");
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp)?;
    }
    std::fs::create_dir_all(tmp.join("bin"))?;
    for bin in ["synerfuse", "synerfuse-torch"] {
        let to = tmp.join("bin").join(bin);
        std::fs::copy(root.join("target").join(profile).join(bin), &to)
            .with_context(|| format!("copying target/{profile}/{bin}"))?;
        strip_binary(&to)?;
    }
    let torch_bin = tmp.join("bin/synerfuse-torch");
    copy_mpi(&torch_bin, &tmp.join("mpi"))?;
    make_data(root, &tmp.join("bin/synerfuse"), &tmp.join("data"))?;
    copy_scripts(root, &tmp)?;
    let bytes = dir_bytes(&tmp)?;
    // A debug bundle is checked here and never travels.
    ensure!(
        debug || bytes <= MAX_BUNDLE_BYTES,
        "the bundle is {:.1} MiB, over its {} MiB",
        bytes as f64 / 1048576.0,
        MAX_BUNDLE_BYTES / 1048576
    );
    if out.exists() {
        std::fs::remove_dir_all(&out)?;
    }
    std::fs::rename(&tmp, &out)?;
    println!(
        "gpu bundle: {} ({:.1} MiB) in {:.0}s; on a GPU machine run: bash {}/check.sh",
        out.display(),
        bytes as f64 / 1048576.0,
        started.elapsed().as_secs_f64(),
        out.strip_prefix(root).unwrap_or(&out).display()
    );
    Ok(out)
}

/// What `check_cpu_as_gpu_machine` hides: this machine's OpenMPI (libraries, programs,
/// components, help and configuration files), so only the bundle's can be found.
const SYSTEM_MPI: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu/openmpi",
    "/usr/lib/x86_64-linux-gnu/pmix2",
    "/usr/share/openmpi",
    "/etc/openmpi",
    "/usr/lib/x86_64-linux-gnu/libmpi.so.40",
    "/usr/lib/x86_64-linux-gnu/libopen-rte.so.40",
    "/usr/lib/x86_64-linux-gnu/libopen-pal.so.40",
    "/usr/lib/x86_64-linux-gnu/libpmix.so.2",
    "/usr/bin/orterun",
    "/usr/bin/orted",
    "/usr/bin/mpirun.openmpi",
];

/// Runs the bundle's `check.sh --cpu` as on a GPU machine: a copy of the bundle, in a
/// mount namespace where the system OpenMPI and this workspace's `.venv` and `target`
/// are hidden, and `.venv` (torch 2.11) is mounted at `/opt/torch/.venv`, first on PATH.
pub fn check_cpu_as_gpu_machine(root: &Path, bundle: &Path) -> Result<()> {
    ensure!(
        Command::new("id")
            .arg("-u")
            .output()?
            .stdout
            .starts_with(b"0\n"),
        "--check-cpu mounts in a namespace of its own: run it as root"
    );
    let scratch = std::env::temp_dir().join(format!("synerfuse-gpu-check-{}", std::process::id()));
    if scratch.exists() {
        std::fs::remove_dir_all(&scratch)?;
    }
    let copy = scratch.join("bundle");
    std::fs::create_dir_all(&scratch)?;
    crate::common::run(
        Command::new("cp").arg("-a").arg(bundle).arg(&copy),
        "copying the bundle",
    )?;
    let venv = std::fs::canonicalize(root.join(".venv"))?;
    // Files first: a library's real path may lie inside a directory hidden next.
    let (mut files, mut dirs) = (String::new(), String::new());
    for path in SYSTEM_MPI {
        let real = std::fs::canonicalize(path).unwrap_or_else(|_| PathBuf::from(path));
        if real.is_dir() {
            dirs += &format!("mount -t tmpfs none {} && ", real.display());
        } else if real.exists() {
            files += &format!("mount --bind /dev/null {} && ", real.display());
        }
    }
    let hide = files + &dirs;
    let script = format!(
        "set -e; mount --make-rprivate / && mount -t tmpfs none /opt && mkdir -p /opt/torch/.venv && \
         mount --bind {venv} /opt/torch/.venv && {hide} \
         mount -t tmpfs none {venv} && mount -t tmpfs none {target} && \
         export PATH=/opt/torch/.venv/bin:$PATH OUT={out} && unset PYTHON LIBTORCH && \
         cd {scratch} && bash {copy}/check.sh --cpu",
        venv = venv.display(),
        target = root.join("target").display(),
        out = scratch.join("out").display(),
        scratch = scratch.display(),
        copy = copy.display(),
    );
    let status = Command::new("unshare")
        .args(["-m", "bash", "-c", &script])
        .status()
        .context("unshare (util-linux)")?;
    let report = std::fs::read_to_string(scratch.join("out/gpu-check.md")).unwrap_or_default();
    println!("{report}");
    ensure!(
        status.success(),
        "check.sh --cpu failed ({status}) in the GPU machine's view; its files are in {}",
        scratch.display()
    );
    std::fs::remove_dir_all(&scratch)?;
    Ok(())
}

/// Strips symbols and removes the rpath (the build machine's libtorch): on the GPU
/// machine every library comes from `LD_LIBRARY_PATH`.
fn strip_binary(bin: &Path) -> Result<()> {
    crate::common::run(Command::new("strip").arg(bin), "strip")?;
    crate::common::run(
        Command::new("patchelf").arg("--remove-rpath").arg(bin),
        "patchelf --remove-rpath (apt-get install patchelf)",
    )?;
    Ok(())
}

/// Copies the OpenMPI runtime that `bin` links into `dir` (lib/, bin/, lib/openmpi3/,
/// lib/pmix/, share/), each library with what it needs beyond [`SYSTEM_LIBS`].
fn copy_mpi(bin: &Path, dir: &Path) -> Result<()> {
    let src = MpiSource::find()?;
    let lib = dir.join("lib");
    for sub in [
        "lib/openmpi3",
        "lib/pmix",
        "bin",
        "share/openmpi",
        "share/pmix",
    ] {
        std::fs::create_dir_all(dir.join(sub))?;
    }
    let mut libs = BTreeSet::new();
    for (name, path) in shared_deps(bin)? {
        if name.starts_with("libmpi") || name.starts_with("libopen-") {
            libs.insert(path.clone());
            libs.extend(shared_deps(&path)?.into_iter().map(|(_, p)| p));
        }
    }
    ensure!(
        !libs.is_empty(),
        "{} links no libmpi: nothing to bundle",
        bin.display()
    );
    for (exe, name) in [(&src.orterun, "mpirun"), (&src.orted, "orted")] {
        std::fs::copy(exe, dir.join("bin").join(name))?;
        libs.extend(shared_deps(exe)?.into_iter().map(|(_, p)| p));
    }
    let mut skipped = Vec::new();
    let mut component_dirs = vec![(&src.components, "lib/openmpi3")];
    if let Some(pmix) = &src.pmix_components {
        component_dirs.push((pmix, "lib/pmix"));
    }
    for (from, to) in component_dirs {
        for entry in std::fs::read_dir(from)? {
            let path = entry?.path();
            if path.extension().is_none_or(|e| e != "so") {
                continue;
            }
            let deps = shared_deps(&path)?;
            if deps
                .iter()
                .any(|(n, _)| SKIPPED_COMPONENT_DEPS.iter().any(|s| n.starts_with(s)))
            {
                skipped.push(path.file_name().unwrap_or_default().to_owned());
                continue;
            }
            std::fs::copy(
                &path,
                dir.join(to).join(path.file_name().unwrap_or_default()),
            )?;
            libs.extend(deps.into_iter().map(|(_, p)| p));
        }
    }
    for path in &libs {
        let name = path.file_name().unwrap_or_default();
        std::fs::copy(path, lib.join(name))
            .with_context(|| format!("copying {}", path.display()))?;
    }
    copy_files(&src.help, &dir.join("share/openmpi"))?;
    if let Some(help) = &src.pmix_help {
        copy_files(help, &dir.join("share/pmix"))?;
    }
    println!(
        "[gpu-bundle] OpenMPI: {} libraries, {} components left out (fabrics this machine has not got)",
        libs.len(),
        skipped.len()
    );
    Ok(())
}

/// The shared libraries `file` loads, by `ldd`, less [`SYSTEM_LIBS`]: (soname, path).
fn shared_deps(file: &Path) -> Result<Vec<(String, PathBuf)>> {
    let out = Command::new("ldd")
        .arg(file)
        .output()
        .with_context(|| format!("ldd {}", file.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut deps = Vec::new();
    for line in text.lines() {
        let Some((name, rest)) = line.trim().split_once(" => ") else {
            continue;
        };
        if SYSTEM_LIBS.iter().any(|s| name.starts_with(s)) {
            continue;
        }
        let path = rest.split(" (").next().unwrap_or("").trim();
        if path == "not found" {
            // libtorch and friends: the GPU machine's PyTorch provides them.
            continue;
        }
        deps.push((name.to_owned(), PathBuf::from(path)));
    }
    Ok(deps)
}

fn copy_files(from: &Path, to: &Path) -> Result<()> {
    for entry in std::fs::read_dir(from)? {
        let path = entry?.path();
        if path.is_file() {
            std::fs::copy(&path, to.join(path.file_name().unwrap_or_default()))?;
        }
    }
    Ok(())
}

/// A small tokenized corpus (the first plays of the Shakespeare corpus, `dir/shk_text_document`)
/// and the GPT-2 style BPE it was tokenized with (`dir/tok/`).
fn make_data(root: &Path, bin: &Path, dir: &Path) -> Result<()> {
    let python = root.join(".venv/bin/python");
    let corpus = crate::setup::corpus_step(root, &python)?;
    let text = std::fs::read_to_string(&corpus)?;
    let first_plays: String = text.lines().take(400).map(|l| format!("{l}\n")).collect();
    let scratch = dir.with_extension("corpus");
    std::fs::create_dir_all(&scratch)?;
    let jsonl = scratch.join("corpus.jsonl");
    std::fs::write(&jsonl, first_plays)?;
    crate::common::tokenized(bin, &jsonl, dir)?;
    std::fs::remove_dir_all(&scratch)?;
    Ok(())
}

/// `check.sh` and the scripts it runs, from `xtask/gpu/`.
fn copy_scripts(root: &Path, dir: &Path) -> Result<()> {
    let src = root.join("xtask/gpu");
    std::fs::copy(src.join("check.sh"), dir.join("check.sh"))?;
    std::fs::create_dir_all(dir.join("check"))?;
    copy_files(&src.join("check"), &dir.join("check"))
}

fn dir_bytes(dir: &Path) -> Result<u64> {
    let mut total = 0;
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        total += if meta.is_dir() {
            dir_bytes(&entry.path())?
        } else {
            meta.len()
        };
    }
    Ok(total)
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join(name))
            .find(|p| p.is_file())
    })
}

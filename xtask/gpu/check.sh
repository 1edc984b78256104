#!/usr/bin/env bash
# synerfuse's GPU check: the whole procedure on a GPU machine, one command, no arguments.
#
#   bash target/gpu-bundle/check.sh          # on a machine with a GPU and PyTorch 2.11
#   bash target/gpu-bundle/check.sh --cpu    # every step that needs no GPU (CPU stands in)
#
# Built by `cargo xtask gpu-bundle`. The binaries carry no library path: libtorch and NCCL
# come from the PyTorch that `python3` (or $PYTHON) imports, OpenMPI from this bundle's
# mpi/ (relocated by the OPAL_* variables below). Results go to $OUT when it is set, else
# ./gpu-check/: gpu-check.json and gpu-check.md, rewritten as each step ends.
#
# The nccl-* steps run two ranks on the one GPU over NCCL with SYNERFUSE_TEST_ONE_GPU_RANKS=1,
# a TEST-ONLY switch of synerfuse-train (src/comm/one_gpu.rs), set by run.py for those runs
# alone: each rank gets an NCCL_HOSTID of its own (NCCL refuses two ranks of one host on one
# device), cuda:0, NCCL_NET=Socket, NCCL_IB_DISABLE=1 and NCCL_SOCKET_IFNAME=lo (unless set),
# so NCCL's socket transport carries them. Never set it to train: the ranks share the GPU.
# With --cpu those ranks compute on the CPU and MPI carries them (each step says which).
set -euo pipefail
BUNDLE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/synerfuse-check.XXXXXX")"
export SYNERFUSE_CHECK_WORK="$WORK"

torch_lib="$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')"
nccl_lib="$("$PY" -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib"))' 2>/dev/null || true)"
# cudarc opens NCCL by its unversioned name; the wheel ships only libnccl.so.2.
mkdir -p "$WORK/nccl"
if [[ -n "$nccl_lib" && -e "$nccl_lib/libnccl.so.2" ]]; then
    ln -sf "$nccl_lib/libnccl.so.2" "$WORK/nccl/libnccl.so"
fi

mpi="$BUNDLE/mpi"
export LD_LIBRARY_PATH="$mpi/lib:$torch_lib:$WORK/nccl${nccl_lib:+:$nccl_lib}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PATH="$mpi/bin:$BUNDLE/bin:$PATH"
export OPAL_PREFIX="$mpi" OPAL_EXEC_PREFIX="$mpi" OPAL_BINDIR="$mpi/bin" OPAL_LIBDIR="$mpi/lib"
export OPAL_PKGLIBDIR="$mpi/lib/openmpi3" OPAL_DATAROOTDIR="$mpi/share" OPAL_DATADIR="$mpi/share"
export OPAL_PKGDATADIR="$mpi/share/openmpi" OPAL_SYSCONFDIR="$mpi/etc"
export OMPI_MCA_mca_base_component_path="$mpi/lib/openmpi3"
# PMIx has install directories of its own: without these it also opens the components
# of a system PMIx of another version (seen on the GPU machines: "undefined symbol").
export PMIX_PREFIX="$mpi" PMIX_EXEC_PREFIX="$mpi" PMIX_LIBDIR="$mpi/lib"
export PMIX_PKGLIBDIR="$mpi/lib/pmix" PMIX_DATAROOTDIR="$mpi/share" PMIX_DATADIR="$mpi/share"
export PMIX_PKGDATADIR="$mpi/share/pmix" PMIX_SYSCONFDIR="$mpi/etc"
export PMIX_MCA_mca_base_component_path="$mpi/lib/pmix" PMIX_MCA_pcompress_base_silence_warning=1
# One machine: shared memory and TCP, no fabric libraries (none are bundled).
export OMPI_MCA_pml=ob1 OMPI_MCA_btl=self,vader,tcp OMPI_MCA_mtl='^ofi' OMPI_MCA_osc='^ucx,pt2pt'
export OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_btl_base_warn_component_unused=0
export OMPI_MCA_rmaps_base_oversubscribe=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

exec "$PY" -u "$BUNDLE/check/run.py" --bundle "$BUNDLE" "$@"

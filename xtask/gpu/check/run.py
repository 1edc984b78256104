"""synerfuse's GPU check, driven by check.sh (which sets the library paths and MPI).

Eighteen steps, each printing one line as it ends and rewriting gpu-check.json and
gpu-check.md, so a run cut short still shows what ran:
  1 probe      GPU, PyTorch, MPI, NCCL, `synerfuse env`
  2 exact      a small LLaMA (GQA, untied), fp32, TF32 off: 6 steps on cuda = on cpu
  3 mixed      a GPU+CPU pipeline and a GPU+CPU data-parallel job = one rank
  3b context   a GPU+CPU context-parallel pair in shares [3, 1], with document masks,
               = one rank
  3c experts   an 8-expert model on a GPU+CPU expert-parallel pair (the GPU 6 experts and
               4x the batch, tokens exchanged each way at every MoE layer) = one rank
  3d nccl-*    two ranks on the one GPU over NCCL (its socket transport; the test-only
               SYNERFUSE_TEST_ONE_GPU_RANKS makes each rank a host of its own), a tiny
               model, 4 steps, each = one rank on the GPU, saying what carried it:
               nccl-dp    DP 2, distributed optimizer in shares 80 : 16 GB, overlapped
                          reduction (reduce-scatter) and parameter gather (all-gather)
               nccl-pp    PP 2, 1F1B with a steady state (NCCL send/recv)
               nccl-tp-sp TP 2 + sequence parallelism
               nccl-cp    CP 2 in shares [3, 1]
               nccl-ep    EP 2, experts [3, 1] (the all-to-all)
               nccl-bf16  bf16 DP 2 against bf16 on one rank (within 1e-3, see BF16_TOL)
  3e islands   two ranks on the GPU (emulated host a) and a CPU rank (host b) in one
               data-parallel group, distributed optimizer in uneven shares, reduced
               hierarchically over the islands [[0, 1], [2]] = one rank
  4 speed      a 1.1B LLaMA, bf16, the largest micro-batch the planner says fits
  5 reference  PyTorch's own loop on the same card, model and batch
  6 memory     the trainer's measured peak against the planner's prediction
  7 planner    `synerfuse profile` on the card, then `synerfuse plan`: predicted step
               time against step 4's measured one
  8 fp16       step 4's run in fp16 (dynamic loss scale) against its bf16 speed, and a
               bf16 replica + an fp16 replica (two ranks on the one GPU, NCCL) against
               one fp32 rank (within 1e-3)
  9 speed-large the largest of a 7B, 5B, 3B and 1.5B LLaMA the planner fits on the
               card (recomputing where it must): tokens/s, MFU, memory against the plan
With --cpu every step runs with the CPU standing in for the GPU (a small model in
steps 4-7; the nccl-* pairs are CPU ranks over MPI, and say so): the plumbing is
checked, the targets are not.
"""

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time

TOL = 1e-4
STARTED = time.time()


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bundle", required=True)
    p.add_argument("--cpu", action="store_true", help="no GPU: the CPU stands in")
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="every step ends within this many seconds of the start; the "
                        "optional torch.compile row runs only with time to spare")
    p.add_argument("--only", default="",
                   help="run only these steps (names, comma-separated): to re-run a step")
    return p.parse_args()


ARGS = parse_args()
BUNDLE = ARGS.bundle
GPU = not ARGS.cpu
WORK = os.environ.get("SYNERFUSE_CHECK_WORK") or "/tmp/synerfuse-check"
OUT = os.environ.get("OUT") or os.path.join(os.getcwd(), "gpu-check")
os.makedirs(OUT, exist_ok=True)
os.makedirs(WORK, exist_ok=True)
SF = os.path.join(BUNDLE, "bin", "synerfuse")
PY = sys.executable
DEV = "cuda" if GPU else "cpu"

RESULT = {
    "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    "mode": "gpu" if GPU else "cpu (the CPU stands in for the GPU)",
    "steps": {},
}


class Failed(Exception):
    pass


def elapsed():
    return time.time() - STARTED


def save():
    path = os.path.join(OUT, "gpu-check.json")
    with open(path + ".tmp", "w") as f:
        json.dump(RESULT, f, indent=1, sort_keys=True)
    os.replace(path + ".tmp", path)
    md = os.path.join(OUT, "gpu-check.md")
    with open(md + ".tmp", "w") as f:
        f.write(markdown())
    os.replace(md + ".tmp", md)


def markdown():
    probe = RESULT["steps"].get("probe", {})
    lines = [f"# synerfuse GPU check, {RESULT['date']}", "",
             f"card: {probe.get('gpu', 'none')}; driver {probe.get('driver', '-')}; "
             f"PyTorch {probe.get('torch', '-')}; mode {RESULT['mode']}", "",
             "| step | status | seconds | result |", "|---|---|---|---|"]
    for name, step in RESULT["steps"].items():
        summary = " / ".join(str(step.get("summary", "")).splitlines()).replace("|", "/")
        lines.append(f"| {name} | {step.get('status')} | {step.get('seconds', 0):.0f} | "
                     f"{summary} |")
    return "\n".join(lines) + "\n"


def step(name, timeout_s):
    """Runs the decorated function as step `name`; its dict is the step's record."""
    def wrap(fn):
        if ARGS.only and name not in ARGS.only.split(","):
            return None
        t0 = time.time()
        record = {"timeout_s": timeout_s}
        RESULT["steps"][name] = record
        deadline = min(t0 + timeout_s, STARTED + ARGS.budget_s)
        try:
            if time.time() > deadline - 5:
                raise Failed(f"not run: the check's {ARGS.budget_s:.0f} s were spent")
            record.update(fn(deadline) or {})
            record.setdefault("status", "pass")
        except Failed as e:
            record.update(status="FAIL", summary=str(e)[:600])
        except subprocess.TimeoutExpired as e:
            record.update(status="FAIL", summary=f"timed out after {e.timeout:.0f} s: {e.cmd[:3]}")
        except Exception as e:  # a bug of this script must not hide the other steps
            record.update(status="FAIL", summary=f"{type(e).__name__}: {e}"[:600])
        record["seconds"] = round(time.time() - t0, 1)
        save()
        print(f"[{elapsed():5.0f}s] step {name}: {record['status']} "
              f"({record['seconds']:.0f} s) {record.get('summary', '')}", flush=True)
        return record
    return wrap


def run(cmd, deadline, log=None, check=True, env=None):
    """Runs `cmd` until `deadline`; its output (also kept in WORK/log)."""
    left = max(5.0, deadline - time.time())
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                       timeout=left, env=env, errors="replace")
    if log:
        with open(os.path.join(WORK, log), "w") as f:
            f.write(p.stdout)
    if check and p.returncode != 0:
        tail = "\n".join(p.stdout.strip().splitlines()[-6:])
        raise Failed(f"`{' '.join(cmd[:2])}` exited {p.returncode}: {tail}")
    return p


def records(path):
    """The iteration records of a --log-json file."""
    out = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "elapsed_ms" in r and "evaluation" not in r:
                out.append(r)
    return out


def worst_rel(a, b):
    if len(a) != len(b) or not a:
        raise Failed(f"{len(a)} losses against {len(b)}")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def needs(key, what):
    """A step that reads an earlier step's result fails, naming it, when it is missing."""
    if key not in STATE:
        raise Failed(f"no {what} (step speed failed)")


def within_tenth(rec, off):
    """Marks `rec` a miss when `off` (relative) is beyond the issue's 10 %."""
    rec["summary"] += f": {off:+.1%} (target within 10 %)"
    if abs(off) > 0.10:
        rec["status"] = "MISS"
    return rec


# ---- the runs ------------------------------------------------------------------------
DATA = os.path.join(BUNDLE, "data")
DATA_FLAGS = ["--data-path", os.path.join(DATA, "shk_text_document"), "--split", "100,0,0",
              "--tokenizer-type", "GPT2BPETokenizer",
              "--vocab-file", os.path.join(DATA, "tok", "vocab.json"),
              "--merge-file", os.path.join(DATA, "tok", "merges.txt"),
              "--data-cache-path", os.path.join(WORK, "cache")]
SMALL = ["--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
         "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "704",
         "--seq-length", "128", "--max-position-embeddings", "128",
         "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--swiglu",
         "--normalization", "RMSNorm"]
EXACT_ITERS = 6


def small_run(name, deadline, extra):
    log = os.path.join(WORK, f"{name}.jsonl")
    if os.path.exists(log):
        os.remove(log)
    cmd = [SF, "train", *SMALL, *DATA_FLAGS, "--train-iters", str(EXACT_ITERS), "--lr", "1e-3",
           "--eval-iters", "0", "--log-interval", "1", "--log-json", log, *extra]
    run(cmd, deadline, log=f"{name}.log")
    return [r["loss"] for r in records(log)]


# The speed model: TinyLlama's shape on a GPU, a small one on the CPU stand-in.
if GPU:
    BIG = dict(layers=22, hidden=2048, heads=32, kv=4, ffn=5632, vocab=32000, seq=2048)
    MBS_CANDIDATES = [16, 12, 10, 8, 6, 4, 2, 1]
else:
    BIG = dict(layers=2, hidden=128, heads=4, kv=2, ffn=352, vocab=4096, seq=128)
    MBS_CANDIDATES = [2]
MICRO_BATCHES = 4
WARMUP, MEASURED = 3, 10


def model_flags(b=None):
    b = b or BIG
    return ["--num-layers", str(b["layers"]), "--hidden-size", str(b["hidden"]),
            "--num-attention-heads", str(b["heads"]), "--group-query-attention",
            "--num-query-groups", str(b["kv"]),
            "--ffn-hidden-size", str(b["ffn"]), "--seq-length", str(b["seq"]),
            "--untie-embeddings-and-output-weights", "--disable-bias-linear"]


def plan_json(mbs, deadline, profile=None, model=None, recompute="off"):
    """The planner's best plan (its JSON) for `model` (step 4's by default) at micro-batch
    size `mbs` on the card, or None where nothing fits."""
    model = model or BIG
    cluster = os.path.join(WORK, "cluster.toml")
    with open(cluster, "w") as f:
        if GPU:
            f.write(f'[[group]]\nkind = "{STATE["slug"]}"\ncount = 1\n')
        else:
            f.write('[[group]]\nkind = "custom"\ncount = 1\ntflops_bf16 = 1.0\n'
                    'memory_gb = 16\nmem_bw_gbs = 50\n')
        f.write("[network]\nintra_node_gbs = 450\ninter_node_gbs = 50\n")
    cmd = [SF, "plan", "--cluster", cluster, *model_flags(model), "--vocab-size",
           str(model["vocab"]), "--global-batch-size", str(mbs * MICRO_BATCHES),
           "--micro-batch-sizes", str(mbs), "--tensor-model-parallel-sizes", "1",
           "--recompute-activations", recompute,
           "--use-distributed-optimizer", "off", "--top-k", "1", "--json"]
    if profile:
        cmd += ["--profile", profile]
    p = run(cmd, deadline, log=f"plan-{mbs}.log", check=False)
    if p.returncode != 0:
        return None
    text = p.stdout
    return json.loads(text[text.index("{"):])


STATE = {"slug": None, "peak_tflops": None}

# ---- 1. probe --------------------------------------------------------------------------


@step("probe", 90)
def probe(deadline):
    rec = {}
    if GPU:
        q = run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                 "--format=csv,noheader"], deadline).stdout.strip().splitlines()[0]
        rec["gpu"], rec["gpu_memory"], rec["driver"] = [x.strip() for x in q.split(",")]
    t = run([PY, "-c", "import torch; print(torch.__version__, torch.version.cuda)"],
            deadline).stdout.split()
    rec["torch"], rec["torch_cuda"] = t[-2], t[-1]
    rec["mpirun"] = run(["mpirun", "--version"], deadline).stdout.strip().splitlines()[0]
    env = run([SF, "env", "--json"], deadline, log="env.json").stdout
    env = json.loads(env[env.index("{"):])
    text = run([SF, "env"], deadline, log="env.txt").stdout
    if "\0" in text:
        raise Failed("`synerfuse env` printed a NUL byte")
    rec["synerfuse_env"] = env
    problems = []
    if not env["libtorch"]["version"].startswith("2.11.0"):
        problems.append(f"libtorch {env['libtorch']['version']} loaded, not 2.11.0")
    if env["mpi"].startswith("unknown"):
        problems.append("no MPI library")
    if GPU:
        if not env["libtorch_cuda"].get("loaded"):
            problems.append(f"libtorch CUDA not loaded: {env['libtorch_cuda']}")
        if env["cuda_devices"] < 1:
            problems.append("no GPU visible to libtorch")
        if not env["nccl_loadable"]:
            problems.append("NCCL not loadable")
        gpus = env.get("gpus") or [{}]
        STATE["slug"] = gpus[0].get("catalogue")
        STATE["peak_tflops"] = gpus[0].get("peak_bf16_tflops")
        if not STATE["slug"]:
            problems.append(f"{rec['gpu']} is not in the device catalogue (no peak for MFU)")
    if problems:
        raise Failed("; ".join(problems))
    rec["summary"] = (f"{rec.get('gpu', 'no GPU')}, torch {rec['torch']}, libtorch "
                      f"{env['libtorch']['version']} from {env['libtorch']['lib_dir']}, "
                      f"{env['mpi'][:40]}, NCCL {'yes' if env['nccl_loadable'] else 'no'}")
    return rec


# ---- 2. exact on the GPU ---------------------------------------------------------------


@step("exact", 60)
def exact(deadline):
    on_dev = small_run("exact-dev", deadline, ["--device", DEV, "--micro-batch-size", "2",
                                               "--global-batch-size", "8"])
    on_cpu = small_run("exact-cpu", deadline, ["--device", "cpu", "--micro-batch-size", "2",
                                               "--global-batch-size", "8"])
    worst = worst_rel(on_dev, on_cpu)
    rec = {"losses_device": on_dev, "losses_cpu": on_cpu, "worst_relative": worst,
           "summary": f"{EXACT_ITERS} steps, fp32: worst relative loss difference {worst:.2e} "
                      f"(target {TOL:g})"}
    if worst > TOL:
        rec["status"] = "MISS"
    return rec


# ---- 3. mixed devices ------------------------------------------------------------------


def plan_file(name, text):
    path = os.path.join(WORK, name)
    with open(path, "w") as f:
        f.write(text)
    return path


@step("mixed", 100)
def mixed(deadline):
    single = small_run("mixed-single", deadline, ["--device", "cpu", "--micro-batch-size", "2",
                                                  "--global-batch-size", "8"])
    pp = plan_file("pp.toml", "[[replica]]\nlayers = [3, 1]\nmicro_batch_size = 2\n"
                   f'num_micro_batches = 4\ndevices = ["{DEV}", "cpu"]\n')
    pipeline = small_run("mixed-pp", deadline, ["--nproc", "2", "--plan", pp])
    single_dp = small_run("mixed-single-dp", deadline, ["--device", "cpu",
                                                        "--micro-batch-size", "2",
                                                        "--global-batch-size", "10"])
    dp = plan_file("dp.toml", "[[replica]]\nlayers = [4]\nmicro_batch_size = 4\n"
                   f'num_micro_batches = 2\ndevices = ["{DEV}"]\n'
                   "[[replica]]\nlayers = [4]\nmicro_batch_size = 1\n"
                   'num_micro_batches = 2\ndevices = ["cpu"]\n')
    data_parallel = small_run("mixed-dp", deadline, ["--nproc", "2", "--plan", dp])
    w_pp, w_dp = worst_rel(pipeline, single), worst_rel(data_parallel, single_dp)
    rec = {"pipeline_worst_relative": w_pp, "data_parallel_worst_relative": w_dp,
           "summary": f"pipeline [3 layers on {DEV}, 1 on cpu]: {w_pp:.2e}; data-parallel "
                      f"({DEV} mbs 4, cpu mbs 1): {w_dp:.2e} (target {TOL:g})"}
    if max(w_pp, w_dp) > TOL:
        rec["status"] = "MISS"
    return rec


# ---- 3b. context parallelism -----------------------------------------------------------


@step("context", 100)
def context(deadline):
    documents = ["--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
    single = small_run("context-single", deadline, ["--device", "cpu", "--micro-batch-size", "2",
                                                    "--global-batch-size", "8", *documents])
    cp = plan_file("cp.toml", "[[replica]]\nlayers = [4]\ncp = [2]\ncp_shares = [[3, 1]]\n"
                   "micro_batch_size = 2\nnum_micro_batches = 4\n"
                   f'devices = ["{DEV}", "cpu"]\n')
    pair = small_run("context-cp", deadline, ["--nproc", "2", "--plan", cp, *documents])
    worst = worst_rel(pair, single)
    rec = {"worst_relative": worst,
           "summary": f"CP 2 [{DEV} 3/4 of every sequence, cpu 1/4], document masks: "
                      f"{worst:.2e} (target {TOL:g})"}
    if worst > TOL:
        rec["status"] = "MISS"
    return rec


# ---- 3c. expert parallelism ------------------------------------------------------------


@step("experts", 100)
def experts(deadline):
    moe = ["--num-experts", "8", "--moe-ffn-hidden-size", "176", "--moe-aux-loss-coeff", "0.01",
           "--moe-router-load-balancing-type", "seq_aux_loss"]
    single = small_run("experts-single", deadline, ["--device", "cpu", "--micro-batch-size", "2",
                                                    "--global-batch-size", "10", *moe])
    ep = plan_file("ep.toml", "[[replica]]\nlayers = [4]\nmicro_batch_size = 4\n"
                   f'num_micro_batches = 2\nexperts = [[0, 1, 2, 3, 4, 5]]\ndevices = ["{DEV}"]\n'
                   "[[replica]]\nlayers = [4]\nmicro_batch_size = 1\n"
                   'num_micro_batches = 2\nexperts = [[6, 7]]\ndevices = ["cpu"]\n')
    pair = small_run("experts-ep", deadline, ["--nproc", "2", "--plan", ep, *moe])
    worst = worst_rel(pair, single)
    rec = {"worst_relative": worst,
           "summary": f"EP 2 [{DEV} experts 0-5 and mbs 4, cpu experts 6-7 and mbs 1]: "
                      f"{worst:.2e} (target {TOL:g})"}
    if worst > TOL:
        rec["status"] = "MISS"
    return rec


# ---- 3d. NCCL between two ranks on the one GPU -------------------------------------------
# Two ranks on the one GPU we borrow, each a host of its own to NCCL through the test-only
# switch SYNERFUSE_TEST_ONE_GPU_RANKS (crates/synerfuse-train/src/comm/one_gpu.rs: its own
# NCCL_HOSTID, cuda:0, NCCL_NET=Socket, NCCL_IB_DISABLE=1), so NCCL's socket transport
# carries their groups and links. A tiny model, 4 steps each, against one rank on the same
# device, losses and gradient norms within TOL in fp32. With --cpu the ranks are CPU ranks
# and MPI carries everything: the plumbing is checked, NCCL is not.

ONE_GPU_ENV = dict(os.environ, SYNERFUSE_TEST_ONE_GPU_RANKS="1")
if GPU:
    ONE_GPU_ENV["NCCL_DEBUG"] = "INFO"  # NCCL names its network and each channel's transport
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
        "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "176",
        "--seq-length", "64", "--max-position-embeddings", "64",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--swiglu",
        "--normalization", "RMSNorm"]
TINY_ITERS = 4
MOE = ["--num-experts", "4", "--moe-ffn-hidden-size", "88", "--moe-aux-loss-coeff", "0.01",
       "--moe-router-load-balancing-type", "seq_aux_loss"]
# bf16 against bf16: each micro-batch is computed alike (the same shapes on one device),
# only the fp32 sums of the gradients run in another order (~1e-7). A master weight that
# close to a bf16 rounding boundary can round to the neighbouring bf16 value, a jump of up
# to 2^-8 (4e-3) in that element; the loss averages thousands of elements, so such flips
# move it far less than bf16's own rounding (2^-9, 2e-3), and 1e-3 (the bound of the
# equivalence tests' bf16 rows, README) leaves them room. A wrong reduction still shows:
# a lost or doubled share moves the gradient norm by tens of percent.
BF16_TOL = 1e-3
REFS = {}


def tiny_run(name, deadline, extra, env=None):
    """A TINY run of TINY_ITERS steps: (its iteration records, its output)."""
    log = os.path.join(WORK, f"{name}.jsonl")
    if os.path.exists(log):
        os.remove(log)
    cmd = [SF, "train", *TINY, *DATA_FLAGS, "--train-iters", str(TINY_ITERS), "--lr", "1e-3",
           "--eval-iters", "0", "--log-interval", "1", "--log-json", log, *extra]
    p = run(cmd, deadline, log=f"{name}.log", env=env, check=False)
    if p.returncode != 0:
        # The trainer's last words, not NCCL_DEBUG's.
        lines = [l for l in p.stdout.strip().splitlines() if "NCCL INFO" not in l]
        raise Failed(f"`{name}` exited {p.returncode}: " + "\n".join(lines[-6:]))
    return records(log), p.stdout


def one_rank(key, deadline, extra):
    """The one-rank reference on DEV (mbs 2 x 4), run once per `key` and shared."""
    if key not in REFS:
        try:
            REFS[key] = tiny_run(f"one-rank-{key}", deadline,
                                 ["--device", DEV, "--micro-batch-size", "2",
                                  "--global-batch-size", "8", *extra])[0]
        except Exception as e:  # noqa: BLE001 - the next step that needs it says so
            REFS[key] = Failed(f"its one-rank reference failed: {e}"[:400])
    if isinstance(REFS[key], Exception):
        raise REFS[key]
    return REFS[key]


def group_paths(output):
    """The paths the trainer logged: its groups' (NCCL, MPI, host-staged) and its links'."""
    paths = []
    for body in re.findall(r"groups of two or more ranks by path: \{(.*)\}\s*$", output, re.M):
        for path, _count in re.findall(r'"([^"]+)": (\d+)', body):
            paths.append("NCCL" if path == "Nccl" else "MPI" if path == "Mpi"
                         else f"MPI host-staged ({path})")
    for path in re.findall(r"pipeline link ranks \d+ <-> \d+: (.*)$", output, re.M):
        path = path.strip()
        paths.append("NCCL" if path.startswith("NCCL") else "MPI" if path == "MPI"
                     else f"MPI host-staged ({path})")
    return sorted(set(paths))


def transport(output):
    """What carried a two-rank run (raises unless NCCL on a GPU, MPI on the CPU)."""
    paths = group_paths(output)
    want = "NCCL" if GPU else "MPI"
    rec = {"transport": paths}
    if not paths:
        raise Failed("the trainer logged no group or link path")
    if paths != [want]:
        raise Failed(f"carried by {', '.join(paths)}, not {want} alone")
    if not GPU:
        rec["carried_by"] = "carried by MPI (the CPU stands in; NCCL not run)"
        return rec
    # NCCL's own word (NCCL_DEBUG=INFO): its network, and each channel's transport.
    networks = sorted(set(re.findall(r"NCCL INFO Using network (\w+)", output)))
    channels = sorted(set(re.findall(r"\] via (NET/\w+|P2P\S*|SHM\S*|COLLNET\S*)", output)))
    hosts = sorted(set(re.findall(r"NCCL_HOSTID set by environment to (\S+)", output)))
    rec.update(nccl_network=networks, nccl_channels=channels, nccl_host_ids=hosts)
    if "Duplicate GPU" in output or len(hosts) == 1:
        raise Failed(f"NCCL saw one GPU twice (NCCL_HOSTID {hosts}, not one per rank)")
    if any(n != "Socket" for n in networks) or any(c != "NET/Socket" for c in channels):
        raise Failed(f"NCCL used network {networks}, channels {channels}, not its sockets")
    seen = f"network {'/'.join(networks) or '?'}, channels via {'/'.join(channels) or '?'}"
    rec["carried_by"] = f"carried by NCCL ({seen})"
    return rec


def against(got, ref, tol, what):
    """The worst relative loss and gradient-norm differences of `got` against `ref`."""
    losses = worst_rel([r["loss"] for r in got], [r["loss"] for r in ref])
    norms = worst_rel([r["grad_norm"] for r in got], [r["grad_norm"] for r in ref])
    rec = {"worst_relative_loss": losses, "worst_relative_grad_norm": norms,
           "losses": [r["loss"] for r in got], "losses_one_rank": [r["loss"] for r in ref],
           "summary": f"{what}: losses {losses:.2e}, grad norms {norms:.2e} (target {tol:g})"}
    if max(losses, norms) > tol:
        rec["status"] = "MISS"
    return rec


def pair_step(name, deadline, plan, extra, ref_key, ref_extra, what, tol=TOL, check=None):
    """A two-rank `plan` (under the switch) against the one-rank reference `ref_key`."""
    ref = one_rank(ref_key, deadline, ref_extra)
    # A hang (two ranks time-slicing one GPU) is named by the watchdog within the step.
    got, output = tiny_run(name, deadline, ["--nproc", "2", "--plan", plan_file(
        f"{name}.toml", plan), "--distributed-timeout-minutes", "0.75", *extra],
        env=ONE_GPU_ENV)
    rec = transport(output)
    if check:
        what += check(got, output, rec)
    rec.update(against(got, ref, tol, what))
    rec["summary"] += f"; {rec['carried_by']}"
    return rec


def replica(layers, mbs, count, devices, more=""):
    return (f"[[replica]]\nlayers = {layers}\nmicro_batch_size = {mbs}\n"
            f"num_micro_batches = {count}\ndevices = {json.dumps(devices)}\n{more}")


def shards(got, output, rec):
    """Each rank's distributed-optimizer shard, from its `optimizer state:` line."""
    sizes = {}
    for r, n in re.findall(r"rank\{r=(\d+)\}.*optimizer state: \d+ bytes \((\d+) of them", output):
        sizes[int(r)] = int(n)
    rec["shard_bytes"] = [sizes.get(r) for r in range(2)]
    if not (sizes.get(0, 0) > sizes.get(1, 0) > 0):
        raise Failed(f"the shards are not 80 : 16: {rec['shard_bytes']}")
    return f" (shards {sizes[0]} : {sizes[1]} B)"


def steady_1f1b(got, output, rec):
    """Stage 0's forwards and backwards in the first step: 1F1B has a backward before a
    forward (the steady state)."""
    order = [f"{s['kind'][0].upper()}{s.get('micro_batch', '')}"
             for s in got[0]["ranks"][0]["spans"] if s["kind"] in ("forward", "backward")]
    rec["stage0_order"] = " ".join(order)
    if not any(a[0] == "B" and b[0] == "F" for a, b in zip(order, order[1:])):
        raise Failed(f"no 1F1B steady state on stage 0: {' '.join(order)}")
    return f" (stage 0: {' '.join(order)})"


def logged(pattern, label):
    def check(got, output, rec):
        m = re.search(pattern, output)
        if not m:
            raise Failed(f"no log line says {label}")
        rec["layout"] = m.group(0)
        return ""
    return check


@step("nccl-dp", 90)
def nccl_dp(deadline):
    plan = (replica([2], 3, 2, [DEV], "memory_gb = [80]\n")
            + replica([2], 1, 2, [DEV], "memory_gb = [16]\n"))
    extra = ["--use-distributed-optimizer", "--overlap-grad-reduce"]
    what = "DP 2 (mbs 3 x 2 | 1 x 2), distributed optimizer 80 : 16 GB, overlapped"
    if "--ddp-bucket-size" in run([SF, "train", "--help"], deadline).stdout:
        # Several buckets of the tiny model's 355k parameters, each reduced on its own.
        extra += ["--ddp-bucket-size", "50000"]
        what += " in buckets of 50k"
    if "--overlap-param-gather" in run([SF, "train", "--help"], deadline).stdout:
        # The updated parameters gathered bucket by bucket inside the next forward.
        extra += ["--overlap-param-gather"]
        what += ", overlapped gather"
    return pair_step("nccl-dp", deadline, plan, extra, "fp32", [], what, check=shards)


@step("nccl-pp", 60)
def nccl_pp(deadline):
    return pair_step("nccl-pp", deadline, replica([1, 1], 2, 4, [DEV, DEV]),
                     ["--pipeline-schedule", "1f1b"], "fp32", [], "PP 2, 1F1B, 4 micro-batches",
                     check=steady_1f1b)


@step("nccl-tp-sp", 60)
def nccl_tp_sp(deadline):
    return pair_step("nccl-tp-sp", deadline, replica([2], 2, 4, [DEV, DEV], "tp = [2]\n"),
                     ["--sequence-parallel"], "fp32", [], "TP 2 + SP",
                     check=logged(r"tensor-parallel ranks \[\[0, 1\]\].*sequence parallel",
                                  "TP 2 with sequence parallelism"))


@step("nccl-cp", 60)
def nccl_cp(deadline):
    plan = replica([2], 2, 4, [DEV, DEV], "cp = [2]\ncp_shares = [[3, 1]]\n")
    return pair_step("nccl-cp", deadline, plan, [], "fp32", [], "CP 2 in shares [3, 1]",
                     check=logged(r"context-parallel ranks \[\[0, 1\]\], shares \[3, 1\]",
                                  "CP 2 in shares [3, 1]"))


@step("nccl-ep", 90)
def nccl_ep(deadline):
    plan = (replica([2], 2, 2, [DEV], "experts = [[0, 1, 2]]\n")
            + replica([2], 2, 2, [DEV], "experts = [[3]]\n"))
    return pair_step("nccl-ep", deadline, plan, MOE, "moe", MOE,
                     "EP 2 (experts 0-2 | 3, all-to-all each way at every MoE layer)",
                     check=logged(r"expert-parallel group \[0, 1\]", "the expert-parallel pair"))


@step("nccl-bf16", 90)
def nccl_bf16(deadline):
    plan = replica([2], 2, 2, [DEV]) + replica([2], 2, 2, [DEV])
    return pair_step("nccl-bf16", deadline, plan, ["--bf16"], "bf16", ["--bf16"],
                     "bf16 DP 2 against bf16 on one rank", tol=BF16_TOL)


@step("islands", 90)
def islands(deadline):
    """Two ranks on DEV (host a, one island) and a CPU rank (host b, another) in one
    data-parallel group reduced hierarchically (inside the island, across, then gathered
    inside the island, or each shard handed over) = one rank: with the distributed
    optimizer in shares 80 : 40 : 16 GB, and plain data parallelism overlapped with the
    backward (several buckets in flight, each island's gathers issued in one order)."""
    ref = one_rank("fp32", deadline, [])
    plan = (replica([2], 2, 2, [DEV], 'memory_gb = [80]\nnodes = ["a"]\n')
            + replica([2], 1, 2, [DEV], 'memory_gb = [40]\nnodes = ["a"]\n')
            + replica([2], 1, 2, ["cpu"], 'memory_gb = [16]\nnodes = ["b"]\n'))
    runs = [("islands", "distributed optimizer 80 : 40 : 16 GB",
             ["--use-distributed-optimizer"]),
            ("islands-overlap", "overlapped all-reduce", ["--overlap-grad-reduce"])]
    # The GPU island over NCCL (the two ranks' own NCCL host ids: SYNERFUSE_TEST_ONE_GPU_RANKS);
    # with --cpu both islands are CPU ranks, and MPI carries every level.
    inside = "NCCL" if GPU else "MPI"
    rec = {"islands": [[0, 1], [2]], "runs": {}}
    worst = []
    for name, what, extra in runs:
        got, output = tiny_run(name, deadline, [
            "--nproc", "3", "--plan", plan_file("islands.toml", plan),
            "--distributed-timeout-minutes", "0.75", "--ddp-bucket-size", "50000", *extra],
            env=ONE_GPU_ENV)
        if not re.search(r"islands \[\[0, 1\], \[2\]\]", output):
            raise Failed(f"{name}: no log line names the islands [[0, 1], [2]]")
        said = re.findall(r"island \[0, 1\] reduce-scatters and gathers over (\w+)", output)
        if not said or any(t != inside for t in said):
            raise Failed(f"{name}: the island [0, 1] should be carried by {inside}, the log "
                         f"says {said or 'nothing'}")
        one = against(got, ref, TOL, f"{what} in buckets of 50k")
        one["transport"] = group_paths(output)
        rec["runs"][name] = one
        worst.append(one["summary"])
        if one.get("status") == "MISS":
            rec["status"] = "MISS"
    rec["carried_by"] = (f"islands [[0, 1], [2]]: {inside} inside [0, 1], host-staged MPI "
                         "across (and for the shards' handover)")
    rec["summary"] = ("DP 3 over islands [2, 1] (DEV, DEV | cpu): " + "; ".join(worst)
                      + f"; {rec['carried_by']}")
    return rec


# ---- 4. speed --------------------------------------------------------------------------


def speed_run(mbs, deadline, precision=None, model=None, extra=(), name=None,
              measured=MEASURED):
    """The speed run of `model` (step 4's by default) at micro-batch size `mbs`, in bf16
    (fp32 with --cpu) or `precision` ("fp16": from a loss scale of 4096, so that no
    measured step is an overflow's skip)."""
    name = name or f"speed-{mbs}" + (f"-{precision}" if precision else "")
    log = os.path.join(WORK, f"{name}.jsonl")
    if os.path.exists(log):
        os.remove(log)
    b = model or BIG
    cmd = [SF, "train", "--device", DEV, *model_flags(b), *extra,
           "--max-position-embeddings", str(b["seq"]), "--swiglu",
           "--normalization", "RMSNorm", "--mock-data", "--tokenizer-type", "NullTokenizer",
           "--vocab-size", str(b["vocab"] - 1), "--micro-batch-size", str(mbs),
           "--global-batch-size", str(mbs * MICRO_BATCHES),
           "--train-iters", str(WARMUP + measured), "--lr", "1e-4", "--min-lr", "1e-5",
           "--eval-iters", "0", "--log-interval", "1", "--log-throughput", "--log-json", log]
    if precision == "fp16":
        cmd += ["--fp16", "--initial-loss-scale", "4096"]
    elif GPU:
        cmd.append("--bf16")
    p = run(cmd, deadline, log=f"{name}.log", check=False)
    return p, log


def speed_record(log, mbs, model, measured=MEASURED):
    """Step 4's figures of a speed run's log: tokens/s, the median step and its spread,
    TFLOP/s per GPU and the MFU."""
    recs = records(log)[WARMUP:]
    if len(recs) < measured:
        raise Failed(f"only {len(recs)} measured steps")
    seconds = sum(r["elapsed_ms"] for r in recs) / 1e3
    tokens = sum(r["global_batch_size"] for r in recs) * model["seq"]
    step_s = sorted(r["elapsed_ms"] for r in recs)[len(recs) // 2] / 1e3
    tflops = sum(r["tflops_per_device"] for r in recs) / len(recs)
    rec = {"micro_batch_size": mbs, "global_batch_size": mbs * MICRO_BATCHES,
           "tokens_per_s": tokens / seconds, "median_step_s": step_s,
           "step_s_spread": [min(r["elapsed_ms"] for r in recs) / 1e3,
                             max(r["elapsed_ms"] for r in recs) / 1e3],
           "tflops_per_gpu": tflops, "model": model}
    mfu = ""
    if STATE["peak_tflops"]:
        rec["mfu"] = tflops / STATE["peak_tflops"]
        mfu = f", MFU {rec['mfu']:.1%} of {STATE['peak_tflops']:g}"
    rec["summary"] = (f"mbs {mbs} x {MICRO_BATCHES}: {tokens / seconds:,.0f} tokens/s, "
                      f"{tflops:.1f} TFLOP/s/GPU{mfu}, median step {step_s:.3f} s")
    return rec


def memory_record(last, plan):
    """A run's measured peak (its last record's rank 0) against the plan's prediction."""
    rank = last["ranks"][0]
    measured = rank["state_bytes"] + (rank.get("activation_peak_bytes") or 0)
    predicted = max(plan["peak_memory_gb_per_stage"]) * 1e9
    rec = {"measured_bytes": measured, "state_bytes": rank["state_bytes"],
           "activation_peak_bytes": rank.get("activation_peak_bytes"),
           "predicted_bytes": predicted, "measured_over_predicted": measured / predicted,
           "summary": f"measured {measured / 1e9:.2f} GB (state {rank['state_bytes'] / 1e9:.2f}), "
                      f"predicted {predicted / 1e9:.2f} GB"}
    return rec, measured / predicted - 1


@step("speed", 200)
def speed(deadline):
    tried = []
    for mbs in MBS_CANDIDATES:
        plan = plan_json(mbs, deadline)
        if plan is None:
            tried.append(f"mbs {mbs}: the planner says it does not fit")
            continue
        p, log = speed_run(mbs, deadline)
        if p.returncode != 0:
            oom = "out of memory" in p.stdout.lower()
            tried.append(f"mbs {mbs}: {'out of memory' if oom else 'exit ' + str(p.returncode)}")
            if oom:
                continue
            raise Failed("; ".join(tried) + ": " + "\n".join(p.stdout.splitlines()[-5:]))
        rec = speed_record(log, mbs, BIG)
        rec["tried"] = tried
        STATE.update(mbs=mbs, plan=plan, step_s=rec["median_step_s"],
                     tokens_per_s=rec["tokens_per_s"], last=records(log)[-1])
        return rec
    raise Failed("no micro-batch size ran: " + "; ".join(tried))


# ---- 5. the PyTorch reference ------------------------------------------------------------


def reference_run(deadline, compiled):
    b, mbs = BIG, STATE["mbs"]
    cmd = [PY, os.path.join(BUNDLE, "check", "reference.py"), "--device", DEV,
           "--layers", str(b["layers"]), "--hidden", str(b["hidden"]), "--heads", str(b["heads"]),
           "--kv-heads", str(b["kv"]), "--ffn", str(b["ffn"]), "--vocab", str(b["vocab"]),
           "--seq", str(b["seq"]), "--mbs", str(mbs), "--accum", str(MICRO_BATCHES),
           "--warmup", str(WARMUP), "--steps", str(MEASURED)]
    if compiled:
        cmd.append("--compile")
    log = f"reference{'-compile' if compiled else ''}.log"
    p = run(cmd, deadline, log=log, check=False)
    if p.returncode != 0 and "out of memory" in p.stdout.lower() and mbs > 1:
        # Same global batch in smaller micro-batches: PyTorch's activations may not fit
        # where ours did.
        i = cmd.index("--mbs")
        cmd[i + 1], cmd[i + 3] = str(mbs // 2), str(MICRO_BATCHES * mbs // (mbs // 2))
        p = run(cmd, deadline, log=log, check=False)
    if p.returncode != 0:
        raise Failed(f"reference exited {p.returncode}: "
                     + " / ".join(p.stdout.strip().splitlines()[-4:]))
    return json.loads(p.stdout.strip().splitlines()[-1])


@step("reference", 240)
def reference(deadline):
    needs("mbs", "speed figure to compare with")
    ref = reference_run(deadline, compiled=False)
    ratio = STATE["tokens_per_s"] / ref["tokens_per_s"]
    rec = {"reference": ref, "ours_over_reference": ratio,
           "summary": f"PyTorch {ref['tokens_per_s']:,.0f} tokens/s ({ref['precision']}); "
                      f"ours / PyTorch = {ratio:.3f} (target 1.0, goal 1.1)"}
    if GPU and elapsed() < ARGS.budget_s - 220:
        try:
            comp = reference_run(deadline, compiled=True)
            rec["reference_compiled"] = comp
            rec["ours_over_compiled"] = STATE["tokens_per_s"] / comp["tokens_per_s"]
            rec["summary"] += (f"; torch.compile {comp['tokens_per_s']:,.0f} tokens/s, ours / it "
                               f"= {rec['ours_over_compiled']:.3f}")
        except (Failed, subprocess.TimeoutExpired) as e:
            rec["reference_compiled"] = f"did not finish: {e}"[:300]
    if ratio < 1.0:
        rec["status"] = "MISS"
    return rec


# ---- 6. memory ---------------------------------------------------------------------------


@step("memory", 30)
def memory(deadline):
    needs("last", "speed run to read")
    rec, off = memory_record(STATE["last"], STATE["plan"])
    return within_tenth(rec, off)


# ---- 7. the planner on the card ----------------------------------------------------------


@step("planner", 120)
def planner(deadline):
    needs("mbs", "measured step to compare with")
    profile = os.path.join(WORK, "profile.json")
    cmd = [SF, "profile", "--device", DEV, *model_flags(), "--vocab-size", str(BIG["vocab"]),
           "--micro-batch-sizes", str(STATE["mbs"]), "--repeats", "3", "--output", profile]
    if GPU:
        cmd.append("--bf16")
    else:
        cmd += ["--device-kind", "custom"]
    run(cmd, deadline, log="profile.log")
    plan = plan_json(STATE["mbs"], deadline, profile=profile)
    if plan is None:
        raise Failed("the planner found no plan with the profile")
    predicted = plan["predicted_step_time_s"]
    off = predicted / STATE["step_s"] - 1
    rec = {"predicted_step_s": predicted, "measured_step_s": STATE["step_s"],
           "predicted_over_measured": predicted / STATE["step_s"],
           "predicted_peak_gb_with_profile": plan["peak_memory_gb_per_stage"],
           "summary": f"predicted {predicted:.3f} s per step, measured {STATE['step_s']:.3f} s"}
    return within_tenth(rec, off)


# ---- 8. fp16 ----------------------------------------------------------------------------


@step("fp16", 150)
def fp16(deadline):
    """fp16's speed against bf16's on the card (step 4's model and batch), and a precision
    per replica: a bf16 replica and an fp16 replica (the job scales the loss; the fp16 one
    scales its own and unscales before the reduction) against one fp32 rank."""
    rec = {}
    if "mbs" in STATE:
        # On the CPU stand-in fp16 is a software path ~14x slower than fp32, its speed
        # meaningless: two measured steps show that it runs.
        measured = MEASURED if GPU else 2
        p, log = speed_run(STATE["mbs"], deadline, precision="fp16", measured=measured)
        if p.returncode != 0:
            raise Failed(f"fp16 speed run exited {p.returncode}: "
                         + " / ".join(p.stdout.strip().splitlines()[-4:]))
        recs = records(log)[WARMUP:]
        seconds = sum(r["elapsed_ms"] for r in recs) / 1e3
        tokens = sum(r["global_batch_size"] for r in recs) * BIG["seq"]
        skipped = sum(1 for r in recs if r.get("skipped"))
        rec.update(fp16_tokens_per_s=tokens / seconds, skipped_measured_steps=skipped,
                   fp16_over_bf16=tokens / seconds / STATE["tokens_per_s"])
        rec["summary"] = (f"fp16 {tokens / seconds:,.0f} tokens/s = "
                          f"{rec['fp16_over_bf16']:.3f}x step 4's ({skipped} skipped); ")
    else:
        rec["summary"] = "no speed run to compare with; "
    ref = one_rank("fp32", deadline, [])
    plan = (replica([2], 2, 2, [DEV], 'precision = ["bf16"]\n')
            + replica([2], 2, 2, [DEV], 'precision = ["fp16"]\n'))
    got, output = tiny_run("fp16-mixed", deadline, [
        "--nproc", "2", "--plan", plan_file("fp16-mixed.toml", plan),
        "--initial-loss-scale", "4096", "--distributed-timeout-minutes", "0.75"],
        env=ONE_GPU_ENV)
    for want in ("computes in bf16 (the plan's", "computes in fp16 (the plan's"):
        if want not in output:
            raise Failed(f"no log line says a rank {want[:16]}")
    mixed = against(got, ref, BF16_TOL, "a bf16 replica + an fp16 replica vs one fp32 rank")
    mixed["transport"] = group_paths(output)
    rec["mixed"] = mixed
    rec["summary"] += mixed["summary"]
    if mixed.get("status") == "MISS":
        rec["status"] = "MISS"
    return rec


# ---- 9. a model that fills the card -------------------------------------------------------

# Largest first; the first the planner fits on the card (recomputing where it must) runs.
# On an H200 (126 GB usable) the planner fits the 5B at micro-batch size 1 (116 GB
# predicted); the 7B needs 147 GB there (a 192 GB card fits it).
if GPU:
    LARGE_CANDIDATES = [
        dict(name="LLaMA-2 7B", layers=32, hidden=4096, heads=32, kv=32, ffn=11008,
             vocab=32000, seq=2048),
        dict(name="5B", layers=32, hidden=3584, heads=28, kv=28, ffn=9728, vocab=32000,
             seq=2048),
        dict(name="LLaMA-3B", layers=26, hidden=3200, heads=32, kv=32, ffn=8640,
             vocab=32000, seq=2048),
        dict(name="1.5B", layers=24, hidden=2048, heads=16, kv=16, ffn=5632, vocab=32000,
             seq=2048),
    ]
    LARGE_MBS = [4, 2, 1]
else:
    LARGE_CANDIDATES = [dict(name="CPU stand-in", layers=2, hidden=192, heads=6, kv=2,
                             ffn=512, vocab=4096, seq=128)]
    LARGE_MBS = [1]
LARGE_MEASURED = 4


@step("speed-large", 150)
def speed_large(deadline):
    """The largest of LARGE_CANDIDATES the planner fits on the card, at the largest
    micro-batch it fits, recomputing activations where the plan does: tokens/s, MFU, and
    the measured peak against the predicted one, so the speed figure is not only a small
    model's."""
    tried = []
    for model in LARGE_CANDIDATES:
        for mbs in LARGE_MBS:
            plan = plan_json(mbs, deadline, model=model, recompute="auto")
            if plan is None:
                tried.append(f"{model['name']} mbs {mbs}: does not fit")
                continue
            recompute = any(any(r) for r in plan["recompute_per_stage_and_replica"])
            extra = ["--recompute-activations"] if recompute else []
            name = f"speed-large-{mbs}"
            p, log = speed_run(mbs, deadline, model=model, extra=extra, name=name,
                               measured=LARGE_MEASURED)
            if p.returncode != 0:
                oom = "out of memory" in p.stdout.lower()
                tried.append(f"{model['name']} mbs {mbs}: "
                             + ("out of memory" if oom else f"exit {p.returncode}"))
                if oom:
                    continue
                raise Failed("; ".join(tried) + ": " + "\n".join(p.stdout.splitlines()[-5:]))
            rec = speed_record(log, mbs, model, measured=LARGE_MEASURED)
            memory, off = memory_record(records(log)[-1], plan)
            rec.update(tried=tried, recompute=recompute, memory=memory)
            rec["summary"] = (f"{model['name']}{' recomputing' if recompute else ''}, "
                              + rec["summary"] + "; memory " + memory["summary"])
            return within_tenth(rec, off)
    raise Failed("no candidate ran: " + "; ".join(tried))


RESULT["total_seconds"] = round(elapsed(), 1)
save()
# Every run's log, for what the summary does not say (small: text and JSON lines).
subprocess.run(["tar", "-czf", os.path.join(OUT, "logs.tar.gz"), "-C", WORK,
                *[f for f in sorted(os.listdir(WORK)) if f.endswith((".log", ".jsonl", ".json",
                                                                       ".toml"))]])
failed = [n for n, s in RESULT["steps"].items() if s["status"] == "FAIL"]
missed = [n for n, s in RESULT["steps"].items() if s["status"] == "MISS"]
print(f"[{elapsed():5.0f}s] done: {len(RESULT['steps']) - len(failed) - len(missed)} passed, "
      f"{len(missed)} missed a target, {len(failed)} failed; results in {OUT}"
      + ("" if GPU else " (without a GPU the targets do not apply: only a failure counts)"),
      flush=True)
# A missed target is a finding to record, not a broken check.
sys.exit(1 if failed else 0)

"""examples/train_distributed.py on two processes: DDP and FSDP2, compiled by fuser, follow a
single-process eager reference step by step, with forward and backward graphs fused and the LM
head's loss run as fuser's chunked linear + cross-entropy.

The script runs under `python -m torch.distributed.run --nproc-per-node 2 --standalone` (a
subprocess: each rank is a process of its own), tiny size, 3 steps (the third's loss is the first
to follow a backward graph's second call, which runs boxed and writes over donated activations),
and its JSON is checked here.  Each rank runs the script's main() with --profile's steps at 1 (the
script's default is 3 under torch.profiler and 3 under cProfile: on CPU two thirds of the test's
time, for the same figures).
Where: by default on CPU (gloo, fp32, Triton's interpreter), the GPUs hidden.  Decision for
FUSER_TEST_DEVICE=cuda: on two GPUs (NCCL, bf16, compiled kernels) where the machine has at least
two, since that is what the GPU run of the suite is for; with one GPU the CPU run instead (NCCL
refuses two ranks on one GPU), so the distributed path is still tested.

Tolerance: tolerances.py's, for the JSON's dtype.  It fits with room: after 3 AdamW steps (the
ranks' half-batch gradients averaged vs the whole batch's, fused vs eager kernels) the losses differ
from the reference's by ~1e-7 relative in fp32 (allowed: 1e-5 + 1e-5 relative) and ~1e-3 in bf16
(measured on CPU; allowed: 1e-2 + 1.6e-2 relative).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tolerances import tol

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parent.parent / "examples" / "train_distributed.py"
# each rank: the script loaded as a module, its profile() given steps=1, its main() run on the arguments after -c
PROFILE_ONE_STEP = """\
import functools, importlib.util, sys
spec = importlib.util.spec_from_file_location("train_distributed", {script!r})
script = sys.modules["train_distributed"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
script.profile = functools.partial(script.profile, steps=1)
script.main(sys.argv[1:])
"""


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_two_ranks_follow_the_reference(wrap, device, tmp_path):
    on_gpus = device == "cuda" and torch.cuda.device_count() >= 2
    if not on_gpus and not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("this torch build has no gloo backend for torch.distributed (the CPU run's)")
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # fuser interprets CPU kernels itself
    if not on_gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""
    # the script's main, run by each rank; --profile's steps cut from 3 (under torch.profiler, then 3 under cProfile)
    # to 1 each: on CPU those six interpreted steps, cProfile's on the interpreter's Python, were two thirds of the
    # test's time, and one step gives every figure checked below
    entry = PROFILE_ONE_STEP.format(script=str(SCRIPT))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                          "--no-python", sys.executable, "-c", entry, "--wrap", wrap, "--backend", "fuser",
                          "--size", "tiny", "--steps", "3",
                          "--out", str(out)] + (["--profile", "--trace", str(tmp_path / "trace")] if wrap == "fsdp2" else []),
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    result = json.loads(out.read_text())
    assert (result["wrap"], result["backend"], result["world_size"]) == (wrap, "fuser", 2)
    assert (result["device"] != "cpu") == on_gpus, result["device"]

    losses, reference = (torch.tensor(result["losses"][k]) for k in ("distributed", "reference"))
    assert len(losses) == len(reference) == 3
    torch.testing.assert_close(losses, reference, **tol(getattr(torch, result["dtype"])))
    assert (losses[1:] < losses[:-1]).all(), losses  # one batch every step: it falls only by training

    # fused, forward and backward, no graph left to eager.  DDP: its graph split in two where the
    # tiny size's 1 MiB buckets end, each piece fused with its backward.  FSDP2: a decoder layer's
    # graph and the LM head's with its loss.
    fusion = result["fusion"]
    assert fusion["backward_graphs"] >= (2 if wrap == "ddp" else 1), fusion
    assert fusion["fused_graphs"] > fusion["backward_graphs"], fusion
    assert fusion["regions"]["forward"] > 0 and fusion["regions"]["backward"] > 0, fusion
    assert fusion["fallbacks"] == [], fusion["fallbacks"]
    # the LM head and its loss as the chunked op, and attention as one op with its backward, under both
    # wrappers (FSDP2's layer graph gets the causal mask as an input: data, so our kernel, not SDPA)
    assert fusion["fused_losses"] == 1 and fusion["fused_attention"] >= 1, fusion
    assert result["median_step_ms"] > 0 and result["compile_s"] >= 0
    assert all((p is not None) == on_gpus for p in result["peak_mib"]), result["peak_mib"]
    if wrap == "fsdp2":  # --profile: the step's wall time, the host's busiest functions (fuser's among them), a
        # trace per rank
        kernels = result["kernels"]
        assert kernels["wall_ms"] > 0 and kernels["host"] and any("runtime.py" in r[0] for r in kernels["ours"]), kernels
        assert all((tmp_path / f"trace.rank{r}.json.gz").stat().st_size > 0 for r in range(2))

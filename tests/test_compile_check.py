"""The offline compile check (``impls.triton.compile_check``): launches recorded in the interpreter, compiled for
sm_90 without a GPU, and a launch the compiler rejects reported by name with a failing exit status."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

from impls.triton import compile_check
from impls.triton.compile_check import Launch, gpu_variant, recorded_launches, write_launches
from impls.triton.merge import merge_attn_states

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="records launches through Triton's interpreter (a CPU-only session)")


def _merge_launch() -> tuple[Launch, torch.Tensor]:
    """The launch of one ``merge_attn_states`` call, recorded, and the output it was given."""
    parts = [(torch.randn(3, 4, 96), torch.randn(3, 4)) for _ in range(2)]
    out = torch.full((3, 4, 96), float("nan"))
    with recorded_launches() as launches:
        merge_attn_states(*parts[0], *parts[1], out=out)
    assert len(launches) == 1
    return launches[0], out


def test_a_recorded_launch_is_not_executed_and_has_the_compilers_types():
    launch, out = _merge_launch()
    assert out.isnan().all()  # recorded instead of run
    assert launch.kernel == "_merge_kernel" and launch.module == "impls.triton.merge"
    assert launch.signature["out_ptr"] == "*fp32" and launch.signature["lse_a_ptr"] == "*fp32"
    assert launch.signature["R"] == "i32" and launch.signature["D"] == "i32"
    assert launch.signature["BLOCK_D"] == "constexpr" and launch.constexprs["BLOCK_D"] == 128
    assert launch.constexprs["INTERP"] is True


def test_the_gpu_variant_turns_interpreter_flags_off_and_gpu_only_flags_on():
    launch = Launch("m", "k", {"INTERPRET": "constexpr", "EARLY_MERGE": "constexpr", "N": "constexpr"},
                    {"INTERPRET": True, "EARLY_MERGE": False, "N": 3}, {"num_warps": 4})
    assert gpu_variant(launch).constexprs == {"INTERPRET": False, "EARLY_MERGE": True, "N": 3}


def test_large_integers_and_unknown_arguments():
    def kernel(a, b, c):
        pass

    launch = compile_check._as_launch(kernel, (2**31, 5, 0.5), {"num_warps": 2})
    assert launch.signature == {"a": "i64", "b": "i32", "c": "fp32"} and launch.options == {"num_warps": 2}
    with pytest.raises(TypeError, match="argument c of type str"):
        compile_check._as_launch(kernel, (1, 2, "x"), {})


def test_launches_compile_for_sm90_and_a_rejected_one_fails_the_check(tmp_path):
    launch, _ = _merge_launch()
    rejected = dataclasses.replace(launch, constexprs={**launch.constexprs, "BLOCK_D": 96})  # arange of 96
    path = tmp_path / "launches.json"
    write_launches(path, [launch, rejected])
    env = dict(os.environ, TRITON_INTERPRET="0")
    done = subprocess.run([sys.executable, "-m", compile_check.MODULE, "--compile", str(path), "--workers", "1"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 of 2 kernel launches compile" in done.stdout
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "_merge_kernel" in failed[0] and "'BLOCK_D': 96" in failed[0]

"""The offline compile check (``impls.triton.compile_check``): launches recorded in the interpreter, compiled for
sm_90 without a GPU, and a launch the compiler rejects reported by name with a failing exit status."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from impls.triton import compile_check, decode, merge
from impls.triton.compile_check import Launch, gpu_variant, gpu_variants, recorded_launches, write_launches
from impls.triton.decode import DecodeConfig, TritonDecode
from impls.triton.merge import merge_attn_states
from mla_bench.problem import build_problem
from mla_bench.workload import Workload

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
    assert {"out_ptr", "lse_a_ptr", "D"} <= set(launch.aligned) and "R" not in launch.aligned  # D 96, R 12
    assert launch.signature["BLOCK_D"] == "constexpr" and launch.constexprs["BLOCK_D"] == 128
    assert launch.constexprs["INTERP"] is False and launch.constexprs["BLOCK_R"] == 16  # as a GPU launches it
    assert merge.INTERPRETING  # and the interpreter's choices back after the block


def test_every_module_choosing_launch_arguments_by_the_interpreter_is_switched_while_recording():
    """A new module reading ``INTERPRETING`` for its launches must join ``HOST_CHOICE_MODULES``, or its launches
    are recorded with the interpreter's tiles and flags."""
    package = Path(compile_check.__file__).parent
    readers = {".".join(("impls", "triton", *path.relative_to(package).with_suffix("").parts))
               for path in package.rglob("*.py")
               if path.stem not in ("common", "compile_check") and "INTERPRETING" in path.read_text()}
    assert readers == set(compile_check.HOST_CHOICE_MODULES)


def test_the_gpu_variant_turns_interpreter_flags_off_and_gpu_only_flags_on():
    launch = Launch("m", "k", {"INTERPRET": "constexpr", "EARLY_MERGE": "constexpr", "KEYS_AHEAD": "constexpr",
                               "N": "constexpr"},
                    {"INTERPRET": True, "EARLY_MERGE": False, "KEYS_AHEAD": 0, "N": 3}, [], {"num_warps": 4})
    assert decode.FIRST_KEYS_AHEAD > 0
    assert gpu_variant(launch).constexprs == {"INTERPRET": False, "EARLY_MERGE": True,
                                              "KEYS_AHEAD": decode.FIRST_KEYS_AHEAD, "N": 3}


def test_a_kernel_that_merges_in_clusters_is_compiled_for_every_cluster_size():
    launch = Launch("m", "k", {"CLUSTER": "constexpr", "N": "constexpr"}, {"CLUSTER": 1, "N": 3}, [], {})
    sizes = [variant.constexprs["CLUSTER"] for variant in gpu_variants(launch)]
    assert sizes == [1, *decode.CLUSTER_SIZES] and len(decode.CLUSTER_SIZES) > 0
    assert [v.constexprs for v in gpu_variants(dataclasses.replace(launch, signature={}, constexprs={"N": 3}))] == [
        {"N": 3}]


def test_arguments_are_specialized_as_tritons_launcher_does():
    def kernel(wide, one, aligned, odd, x, tensor, N: "tl.constexpr"):  # noqa: F821 - an annotation, as in kernels
        pass

    launch = compile_check._as_launch(kernel, (2**31, 1, 32, 17, 0.5, torch.randn(8)[1:], 4), {"num_warps": 2})
    assert launch.signature == {"wide": "i64", "one": "constexpr", "aligned": "i32", "odd": "i32", "x": "fp32",
                                "tensor": "*fp32", "N": "constexpr"}
    assert launch.constexprs == {"one": 1, "N": 4} and launch.options == {"num_warps": 2}
    assert launch.aligned == ["wide", "aligned"]  # the tensor starts 4 bytes into its storage


def _decode_launch(config: DecodeConfig, layout: str = "bf16", page_size: int = 64) -> Launch:
    problem = build_problem(Workload(mode="decode", preset="tiny", num_heads=16, q_lens=(1,), kv_lens=(70,),
                                     layout=layout, page_size=page_size), torch.device("cpu"))
    impl = TritonDecode()
    impl.config = config
    with recorded_launches() as launches:
        impl.run(impl.plan(problem))
    return launches[0]


def _compile_phase(tmp_path: Path, launches: list[Launch], pythonpath: Path | None = None
                   ) -> subprocess.CompletedProcess:
    """The check's compile phase over ``launches`` in its own process, resources printed; ``pythonpath`` goes first
    on its path (where a launch's module lives)."""
    path = tmp_path / "launches.json"
    write_launches(path, launches)
    env = dict(os.environ, TRITON_INTERPRET="0")
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(pythonpath), env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", compile_check.MODULE, "--compile", str(path), "--workers", "2",
                           "--resources"], env=env, capture_output=True, text=True, timeout=900)


def test_launches_compile_for_sm90_and_rejected_ones_fail_the_check_by_name(tmp_path):
    launch, _ = _merge_launch()
    rejected = dataclasses.replace(launch, constexprs={**launch.constexprs, "BLOCK_D": 96})  # arange of 96
    too_deep = _decode_launch(DecodeConfig(16, 64, num_warps=4, num_stages=4))  # four 72 KB tiles: 241,664 bytes
    done = _compile_phase(tmp_path, [launch, rejected, too_deep])
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 of 3 kernel launches compile" in done.stdout
    lines = done.stdout.splitlines()
    failed = [line for line in lines if line.startswith("FAILED")]
    assert len(failed) == 2
    assert any("_merge_kernel" in line and "'BLOCK_D': 96" in line for line in failed)
    assert any("_decode_split_kernel" in line and "'num_stages': 4" in line for line in failed)
    assert "needs 241664 bytes of shared memory" in done.stdout
    usage = [line for line in lines if "registers" in line and "_merge_kernel" in line]
    assert len(usage) == 1 and "bytes spilled" in usage[0] and "bytes shared" in usage[0], done.stdout


def test_the_gluon_decode_kernels_are_recorded_as_on_hopper_and_compile_for_sm90(tmp_path):
    """The interpreter cannot run Gluon: its launches are recorded from plans made as on a Hopper GPU, and compiled:
    decode_wgmma_ws (TMA descriptors of the query and the cache in its signature) in pages of whole tiles and in
    pages it gathers, each also for every cluster size, and decode_wgmma (``tma_loader`` off)."""
    wgmma = DecodeConfig(block_m=64, block_n=64, num_warps=8, gluon=True)
    ws = _decode_launch(wgmma)
    assert ws.kernel == "_decode_split_kernel_wgmma_ws" and ws.options == {"num_warps": 4, "maxnreg": 168}
    assert ws.signature["q_desc"].startswith("tensordesc<bf16[64, 64]") and ws.constexprs["PAGE_SIZE"] == 64
    gathering = _decode_launch(wgmma, page_size=16)
    assert gathering.kernel == ws.kernel and gathering.constexprs["PAGE_SIZE"] == 16
    launch = _decode_launch(dataclasses.replace(wgmma, tma_loader=False))
    assert launch.kernel == "_decode_split_kernel_wgmma" and launch.options == {"num_warps": 8}
    assert launch.signature["cache"] == "*bf16" and launch.constexprs["PAGE_SIZE"] == 64
    done = _compile_phase(tmp_path, [ws, gathering, launch])
    assert done.returncode == 0, done.stdout + done.stderr
    count = 2 * (1 + len(decode.CLUSTER_SIZES)) + 1
    assert f"{count} of {count} kernel launches compile" in done.stdout


def test_a_gluon_launch_whose_wgmmas_ptxas_serializes_fails_the_check_by_name(tmp_path):
    """ptxas's info that it serialized a launch's wgmmas fails a Gluon launch (a planted kernel), and
    decode_rs_fp8, whose products ptxas serialized until session 39, compiles with them in flight, for fp8_ds_mla
    and for nvfp4 (session 41: other register splits serialize it)."""
    planted = Launch("planted_serialized_wgmma", "serialized_products",
                     {"a": "*fp16", "b": "*fp16", "out": "*fp32"}, {}, ["a", "b", "out"], {"num_warps": 4})
    rs = [_decode_launch(decode.WS_CONFIG, layout) for layout in ("fp8_ds_mla", "nvfp4")]
    assert all(launch.kernel == "_decode_split_kernel_rs_fp8" for launch in rs)
    assert [launch.constexprs["LAYOUT"] for launch in rs] == ["fp8_ds_mla", "nvfp4"]
    done = _compile_phase(tmp_path, [planted, *rs], pythonpath=Path(__file__).parent)
    assert done.returncode == 1, done.stdout + done.stderr
    rs_variants = 2 * (1 + len(decode.CLUSTER_SIZES))  # each also in clusters (gpu_variants)
    assert f"{rs_variants} of {rs_variants + 1} kernel launches compile" in done.stdout
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    assert len(failed) == 1 and "serialized_products" in failed[0], done.stdout
    assert "wgmma.mma_async instructions are serialized" in done.stdout
    usage = [line for line in done.stdout.splitlines() if "_decode_split_kernel_rs_fp8" in line]
    assert len(usage) == rs_variants and all("registers" in line and "serialized" not in line for line in usage), (
        done.stdout)


def test_every_query_dtype_the_impls_declare_is_compiled():
    """A dtype an impl declares takes its own kernel variant (float16 pointers, other tiles): the check compiles the
    launches of each declared one, as the conformance tests run each (the sparse impls declared float16 before the
    check drove any float16 launch)."""
    from impls.triton.chunked import TritonChunkedPrefill
    from impls.triton.prefill import TritonPrefill
    from impls.triton.sparse import TritonSparse, TritonSparseRagged

    with recorded_launches() as launches:
        compile_check._drive_impls()
    pointer = {"bfloat16": "*bf16", "float16": "*fp16"}
    for impl, kernel in ((TritonSparse, "_sparse_kernel"), (TritonSparseRagged, "_sparse_kernel"),
                         (TritonPrefill, "_prefill_kernel"), (TritonChunkedPrefill, "_prefill_kernel"),
                         (TritonDecode, "_decode_split_kernel")):
        compiled = {launch.signature["Q" if "Q" in launch.signature else "q"] for launch in launches
                    if launch.kernel == kernel}
        assert {pointer[dtype] for dtype in impl.capabilities.dtypes} <= compiled, (impl.name, compiled)

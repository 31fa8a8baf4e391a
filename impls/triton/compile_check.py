"""Compile every Triton kernel of ``impls/triton`` for a Hopper GPU on a machine without one.

``python -m impls.triton.compile_check [--triton-path DIR]``: exit status 0 when every launch compiles.

The CPU tests run the kernels in Triton's interpreter, which executes their Python and never runs Triton's
compiler: a kernel that one Triton version's front end rejects passes every CPU test and fails on the GPU machine
(round 8 lost its device time that way: a constexpr parameter with a default value compiles with Triton 3.9, not
with the GPU machine's 3.6). So this check:

1. records launches: in a process with ``TRITON_INTERPRET=1``, the impls plan and run small problems with the
   configurations a GPU gets by default (``default_config`` with a CUDA device, Hopper or not, and
   ``decode.MMA_FP8_CONFIG``, a kernel no longer chosen by default but selectable; the decode's cut in two splits, so
   that its merge runs too, and once in many as on a GPU of 132 SMs, whose merge narrows its rows), every cache layout
   and the page sizes that change a kernel; each launch's argument types, constexprs, 16-aligned arguments (as
   Triton's launcher specializes them: the aligned loads are what pipelines through shared memory) and launch options
   are recorded and its execution skipped. Gluon kernels (``decode_wgmma``, ``decode_wgmma_ws``,
   ``decode_wgmma_narrow``, ``decode_wgmma_fp8``, ``decode_mma_fp8``, ``decode_ws``, ``decode_rs_fp8``,
   ``sparse_wgmma``), which the interpreter cannot run, are planned as on a Hopper GPU and their launches recorded the
   same way;
2. compiles each distinct launch for ``sm_90`` with ``triton.compile`` in a process without the interpreter, with
   the interpreter flags off and the GPU-only constexprs at their GPU values (``GPU_ONLY_FLAGS`` on: the
   programmatic launches' waits and releases; ``KEYS_AHEAD``, the keys asked of L2 before the wait, at
   ``decode.FIRST_KEYS_AHEAD``; a kernel that merges in clusters once more for each of ``decode.CLUSTER_SIZES``, which
   only a GPU's plan asks for); a kernel that needs more shared memory than a program may have on sm_90 fails too.
   ptxas ships with Triton's wheel. ``--resources`` also prints each launch's registers and spills (``ptxas -v``)
   and shared memory;
3. asks ptxas (``-v``) whether it serialized a Gluon launch's wgmmas (infos C7508-C7512, e.g. too few registers
   to keep the products' operands in flight: every product then waits for the one before; session 38 found it in
   decode_rs_fp8 only by reading the SASS), and fails the launch if so: the Gluon kernels are written for products
   in flight. Triton-language kernels leave the registers to Triton: theirs is shown with ``--resources``.

``--triton-path DIR`` puts another Triton first on the path of both processes: ``make compile-check`` runs the
check with the installed Triton and with the GPU machine's (``pip install --target DIR triton==3.6.0``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import inspect
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from unittest import mock

import torch

MODULE = "impls.triton.compile_check"  # run as ``-m``, this module's __name__ is "__main__"
TARGET = ("cuda", 90, 32)  # Hopper (H100/H200): backend, compute capability, warp size
SHARED_MEMORY_LIMIT = 232_448  # bytes of shared memory one program may use on sm_90 (the opt-in maximum)
INTERPRETER_FLAGS = ("INTERPRET",)  # the decode's constexpr for the interpreter's code (its plan needs it on here)
# Modules whose launches choose tiles and constexprs (INTERP, UPCAST) by ``INTERPRETING``: off while recording.
HOST_CHOICE_MODULES = ("impls.triton.latent_io", "impls.triton.merge", "impls.triton.prefill_kernel",
                       "impls.triton.sparse_kernel")
GPU_ONLY_FLAGS = ("EARLY_MERGE", "WAIT_PRIOR", "RELEASE_NEXT")  # constexprs a plan turns on only on a GPU
DECODE_PAGE_SIZES = (1, 16, 64)  # page 1 prefetches table lines, 16 is under a tile, 64 fills one
SERIALIZED = re.compile(r"wgmma\.mma_async instructions are serialized[^\n]*")  # ptxas -v's performance info


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch as the compiler sees it: where the kernel lives, each argument's type (``constexpr`` for
    compile-time ones), the constexprs' values, the arguments known 16-aligned (pointers, integers) and the launch
    options (``num_warps``, ``num_stages``, ...)."""

    module: str
    kernel: str
    signature: dict
    constexprs: dict
    aligned: list
    options: dict

    def key(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @property
    def label(self) -> str:
        shown = {k: v for k, v in self.constexprs.items() if k not in INTERPRETER_FLAGS}
        return f"{self.kernel} {shown} {self.options}"


# ---- 1. recording, in the interpreter ----------------------------------------------------------------------------

def _as_launch(fn, args: tuple, kwargs: dict) -> Launch:
    """The ``Launch`` of ``fn(*args, **kwargs)``: arguments bound to its parameters (defaults applied) and typed,
    specialized and marked 16-aligned as Triton's launcher does (ints equal to 1 become constexprs); the rest of
    ``kwargs`` launch options."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    signature_of_fn = inspect.signature(fn)
    params = signature_of_fn.parameters
    bound = signature_of_fn.bind(*args, **{k: v for k, v in kwargs.items() if k in params})
    bound.apply_defaults()
    signature, constexprs, aligned = {}, {}, []
    for name, value in bound.arguments.items():
        if "constexpr" in str(fn.__annotations__.get(name, "")):
            signature[name], constexprs[name] = "constexpr", value
            continue
        kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            constexprs[name] = key
        elif key == "D":
            aligned.append(name)
    options = {k: v for k, v in kwargs.items() if k not in params}
    return Launch(fn.__module__, fn.__name__, signature, constexprs, aligned, options)


def _drive_impls() -> None:
    """Plan and run small problems through every Triton path with the GPU's default configurations."""
    from impls.triton import common, decode, prefill_kernel, sparse_kernel
    from impls.triton.cache_ops import gather_cache_triton, has_kernel, write_cache_triton
    from impls.triton.chunked import TritonChunkedPrefill
    from impls.triton.kv_indices import kv_indices_triton
    from impls.triton.latent_io import LAYOUT_CODES
    from impls.triton.merge import merge_attn_states, rescale_partial
    from impls.triton.prefill import TritonPrefill
    from impls.triton.sparse import TritonSparse, TritonSparseRagged
    from mla_bench.layouts import LATENT_DIM, LAYOUTS
    from mla_bench.problem import build_problem
    from mla_bench.workload import Workload

    def split_and_kept(config: decode.DecodeConfig) -> decode.DecodeConfig:
        """Cut in two splits whose partials are kept in L2: the merge kernel runs, and the split kernel's store
        branches are all compiled (a request's direct store is a runtime branch of the same kernel)."""
        return dataclasses.replace(config, num_splits=2, keep_partials=True)

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    for layout in LAYOUTS:
        for page_size in DECODE_PAGE_SIZES:
            configs = {decode.default_config(heads, q_len, layout, page_size, keys_per_sm, hopper, gbps_per_sm)
                       for heads in (16, 32, 64, 128) for q_len in (1, 2, 4) for keys_per_sm in (0.0, 1e9)
                       for hopper in (False, True) for gbps_per_sm in (0.0, 1e9)}
            if layout in decode.FP8_DS_MLA:  # no default, still selectable
                configs.add(decode.MMA_FP8_CONFIG)
            problem = build_problem(Workload(mode="decode", preset="tiny", num_heads=16, layout=layout,
                                             page_size=page_size, q_lens=(1, 2), kv_lens=(70, 9)), cpu)
            for config in sorted(configs, key=repr):
                meta = problem.meta
                decode.run_decode(decode.plan_decode(problem.q, problem.cache, meta.block_table, meta.q_lens,
                                                     meta.kv_lens, problem.scale, config=split_and_kept(config)))
        cache = problem.cache
        if has_kernel(cache.layout):
            slots = torch.tensor([0, 5, 17], dtype=torch.int64)
            write_cache_triton(cache, torch.randn(3, LATENT_DIM), slots, validate=False)
            gather_cache_triton(cache, slots, validate=False)
    # One request cut in 33 as on a GPU of 132 SMs (this machine's plan says 4): the merge narrows its rows.
    long = build_problem(Workload(mode="decode", preset="tiny", num_heads=16, q_lens=(1,), kv_lens=(4200,),
                                  page_size=64), cpu)
    config = dataclasses.replace(split_and_kept(decode.default_config(16, 1)), num_splits=64)
    with mock.patch.object(common, "sm_count", lambda device: 132):
        decode.run_decode(decode.plan_decode(long.q, long.cache, long.meta.block_table, long.meta.q_lens,
                                             long.meta.kv_lens, long.scale, config=config))

    # every query dtype the sparse, chunked and prefill impls declare (float16 takes other kernels or tiles)
    for (layout, code), dtype in itertools.product(LAYOUT_CODES.items(), ("bfloat16", "float16")):
        for mode in ("sparse_decode", "sparse_prefill"):
            for impl, transform in ((TritonSparse, "paged"), (TritonSparseRagged, "ragged")):
                problem = build_problem(Workload(mode=mode, q_lens=(2, 1), kv_lens=(70, 33), page_size=16,
                                                 layout=layout, dtype=dtype, topk=32, index_transform=transform), cpu)
                for heads, hopper in itertools.product((16, 64, 128), (False, True)):
                    config = sparse_kernel.default_config(gpu, heads, code, problem.q.dtype, hopper=hopper)
                    for splits in (None, 2):  # cut in two: the float32 partials' store and the merge
                        runner = impl(dataclasses.replace(config, num_splits=splits))
                        runner.run(runner.plan(problem))
        chunked = TritonChunkedPrefill(prefill_kernel.default_config(gpu))
        problem = build_problem(Workload(mode="chunked_prefill", q_lens=(3, 2), kv_lens=(40, 9), page_size=16,
                                         layout=layout, dtype=dtype, chunk_size=16), cpu)
        chunked.run(chunked.plan(problem))
    for dtype in ("bfloat16", "float16"):
        prefill = TritonPrefill(prefill_kernel.default_config(gpu))
        prefill.run(prefill.plan(build_problem(Workload(mode="prefill", q_lens=(5, 3), kv_lens=(5, 3), dtype=dtype),
                                               cpu)))
    parts = [(torch.randn(3, 4, 512), torch.randn(3, 4)) for _ in range(2)]
    merge_attn_states(*parts[0], *parts[1])
    rescale_partial(parts[0][0], torch.stack([lse for _, lse in parts]), rank=1)
    kv_indices_triton(torch.tensor([0, 2, 3], dtype=torch.int32), torch.arange(6, dtype=torch.int32).view(2, 3), 3)


@contextlib.contextmanager
def recorded_launches():
    """Within the block, interpreted kernel launches are recorded instead of executed, with the arguments a GPU
    would get (the modules' ``INTERPRETING`` off: GPU tile sizes, no float32 upcasts): yields the ``Launch``
    objects, one per distinct launch, in order."""
    from triton.experimental.gluon._runtime import GluonJITFunction
    from triton.runtime.interpreter import InterpretedFunction

    from impls.triton import common

    host_choices = [module for module in map(importlib.import_module, HOST_CHOICE_MODULES)
                    if getattr(module, "INTERPRETING", False)]
    recorded: list[Launch] = []
    keys: set[str] = set()

    def run_recorded(self, *args, grid, warmup, **kwargs):
        launch = _as_launch(self.fn, args, kwargs)
        key = launch.key()
        if key not in keys:
            keys.add(key)
            recorded.append(launch)

    for module in host_choices:
        module.INTERPRETING = False
    try:
        with mock.patch.object(InterpretedFunction, "run", run_recorded), \
                mock.patch.object(GluonJITFunction, "run", run_recorded), \
                mock.patch.object(common, "has_wgmma", lambda device: True):
            yield recorded
    finally:
        for module in host_choices:
            module.INTERPRETING = True


def write_launches(path: Path, launches: list[Launch]) -> None:
    path.write_text(json.dumps([dataclasses.asdict(launch) for launch in launches]))


# ---- 2. compiling, without the interpreter ------------------------------------------------------------------------

def gpu_variant(launch: Launch) -> Launch:
    """What a GPU compiles of a recorded launch: interpreter flags off, GPU-only constexprs at their GPU values
    (their off state is the same code without the added calls)."""
    from impls.triton.decode import FIRST_KEYS_AHEAD

    gpu_only = {**dict.fromkeys(GPU_ONLY_FLAGS, True), "KEYS_AHEAD": FIRST_KEYS_AHEAD}
    constexprs = {k: False if k in INTERPRETER_FLAGS else gpu_only.get(k, v) for k, v in launch.constexprs.items()}
    return dataclasses.replace(launch, constexprs=constexprs)


def gpu_variants(launch: Launch) -> list[Launch]:
    """``gpu_variant``, and for a kernel that can merge in clusters (a ``CLUSTER`` constexpr, 1 where recorded: a
    plan on the CPU has none) also its variant for each cluster size (``decode.CLUSTER_SIZES``)."""
    from impls.triton.decode import CLUSTER_SIZES

    variant = gpu_variant(launch)
    if "CLUSTER" not in variant.constexprs:
        return [variant]
    return [variant] + [dataclasses.replace(variant, constexprs={**variant.constexprs, "CLUSTER": size})
                        for size in CLUSTER_SIZES]


def compile_launch(launch: Launch, resources: bool = False) -> tuple[str | None, str]:
    """Compile ``launch`` for ``TARGET``: (why it fails on the GPU, or None; with ``resources``, its registers,
    spills and shared memory as ptxas and Triton report them)."""
    import triton
    from triton.backends.compiler import BaseBackend, GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = getattr(importlib.import_module(launch.module), launch.kernel)
    try:
        divisible = BaseBackend.parse_attr("D")  # what the launcher tells the compiler of a 16-aligned argument
        attrs = {(i,): divisible for i, name in enumerate(launch.signature) if name in launch.aligned}
        source_type = GluonASTSource if kernel.is_gluon() else ASTSource
        source = source_type(kernel, dict(launch.signature), dict(launch.constexprs), attrs)
        compiled = triton.compile(source, target=GPUTarget(*TARGET), options=dict(launch.options))
    except Exception as error:  # noqa: BLE001 - any compiler failure is the finding
        return _innermost(error), ""
    shared = compiled.metadata.shared
    if shared > SHARED_MEMORY_LIMIT:
        return f"needs {shared} bytes of shared memory; a program may use at most {SHARED_MEMORY_LIMIT}", ""
    gluon = kernel.is_gluon()
    if not (gluon or resources):
        return None, ""
    report = _ptxas_report(compiled.asm["ptx"])
    serialized = SERIALIZED.search(report)
    if gluon and serialized:
        return (f"ptxas: {serialized.group(0).strip()}: each product waits for the one before (give the partition "
                f"issuing them more registers)"), ""
    return None, f"{_usage(report, bool(serialized))}, {shared} bytes shared" if resources else ""


def _ptxas_report(ptx: str) -> str:
    """What ``ptxas -v`` (Triton's own ptxas) says of ``ptx``: registers, spills and performance notes."""
    from triton.backends.nvidia import compiler

    ptxas = compiler.get_ptxas(TARGET[1]).path
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "kernel.ptx"
        source.write_text(ptx)
        return subprocess.run([ptxas, f"-arch=sm_{TARGET[1]}a", "-v", str(source), "-o", os.devnull],
                              capture_output=True, text=True).stderr


def _usage(report: str, serialized: bool) -> str:
    """Registers per thread and spilled bytes from a ``ptxas -v`` report, and whether the wgmmas are serialized."""
    registers = re.search(r"Used (\d+) registers", report)
    spilled = re.search(r"(\d+) bytes spill stores", report)
    return (f"{registers.group(1) if registers else '?'} registers, "
            f"{spilled.group(1) if spilled else '?'} bytes spilled{', wgmmas serialized' if serialized else ''}")


def _innermost(error: BaseException) -> str:
    """The deepest error of a chain (Triton wraps an error in a called function once per call level): its last
    lines, which show the source line, and the error under it when that has no source."""
    chain = [error]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    located = [e for e in chain if str(e).strip()]
    text = "\n".join(str(located[-1]).strip().splitlines()[-12:]) if located else ""
    return text if chain[-1] in located else f"{text}\n{chain[-1]!r}"


def compile_all(path: Path, workers: int, resources: bool = False) -> int:
    """Compile every GPU variant of the launches in ``path``; print failures (and with ``resources`` each launch's
    registers, spills and shared memory); the number of failures."""
    import triton

    launches = {v.key(): v for raw in json.loads(path.read_text()) for v in gpu_variants(Launch(**raw))}
    ordered = sorted(launches.values(), key=lambda launch: launch.key())
    with ProcessPoolExecutor(max_workers=workers) as pool:
        results = list(pool.map(functools.partial(compile_launch, resources=resources), ordered))
    failures = 0
    for launch, (error, usage) in zip(ordered, results):
        if error:
            failures += 1
            print(f"FAILED {launch.label}\n{error}\n")
        elif usage:
            print(f"{usage:60s} {launch.label}")
    print(f"Triton {triton.__version__}, sm_{TARGET[1]}: {len(ordered) - failures} of {len(ordered)} kernel "
          f"launches compile")
    return failures


# ---- the two processes ---------------------------------------------------------------------------------------------

def _phase(name: str, path: Path, interpret: bool, args: argparse.Namespace) -> int:
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    if args.triton_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(args.triton_path), env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", MODULE, f"--{name}", str(path), "--workers", str(args.workers),
               *(["--resources"] if args.resources else [])]
    return subprocess.run(command, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triton-path", help="a directory holding another Triton, put first on the path")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--resources", action="store_true",
                        help="print each launch's registers, spills and shared memory")
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)  # phase 1, in its own process
    parser.add_argument("--compile", type=Path, help=argparse.SUPPRESS)  # phase 2, in its own process
    args = parser.parse_args(argv)
    if args.record:
        with recorded_launches() as launches:
            _drive_impls()
        write_launches(args.record, launches)
        return 0
    if args.compile:
        return 1 if compile_all(args.compile, args.workers, args.resources) else 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "launches.json"
        return _phase("record", path, True, args) or _phase("compile", path, False, args)


if __name__ == "__main__":
    sys.exit(main())

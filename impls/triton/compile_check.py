"""Compile every Triton kernel of ``impls/triton`` for a Hopper GPU on a machine without one.

``python -m impls.triton.compile_check [--triton-path DIR]``: exit status 0 when every launch compiles.

The CPU tests run the kernels in Triton's interpreter, which executes their Python and never runs Triton's
compiler: a kernel that one Triton version's front end rejects passes every CPU test and fails on the GPU machine
(round 8 lost its device time that way: a constexpr parameter with a default value compiles with Triton 3.9, not
with the GPU machine's 3.6). So this check:

1. records launches: in a process with ``TRITON_INTERPRET=1``, the impls plan and run small problems with the
   configurations a GPU gets by default (``default_config`` with a CUDA device; the decode's cut in two splits, so
   that its merge runs too), every cache layout and the page sizes that change a kernel; each launch's argument
   types, constexprs and launch options are recorded and its execution skipped;
2. compiles each distinct launch for ``sm_90`` with ``triton.compile`` in a process without the interpreter, with
   the interpreter flags off and the GPU-only flags (``EARLY_MERGE``) on. ptxas ships with Triton's wheel. What
   only a launch shows (more shared memory than an SM has) is not checked.

``--triton-path DIR`` puts another Triton first on the path of both processes: ``make compile-check`` runs the
check with the installed Triton and with the GPU machine's (``pip install --target DIR triton==3.6.0``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

MODULE = "impls.triton.compile_check"  # run as ``-m``, this module's __name__ is "__main__"
TARGET = ("cuda", 90, 32)  # Hopper (H100/H200): backend, compute capability, warp size
INTERPRETER_FLAGS = ("INTERPRET", "INTERP")  # constexprs that select the interpreter's code: off on a GPU
GPU_ONLY_FLAGS = ("EARLY_MERGE",)  # constexprs a plan turns on only on a GPU: compiled on
DECODE_PAGE_SIZES = (1, 16, 64)  # page 1 prefetches table lines, 16 is under a tile, 64 fills one
POINTER_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64",
                 torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
                 torch.bool: "i1", torch.float8_e4m3fn: "fp8e4nv"}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch as the compiler sees it: where the kernel lives, each argument's type (``constexpr`` for
    compile-time ones), the constexprs' values and the launch options (``num_warps``, ``num_stages``, ...)."""

    module: str
    kernel: str
    signature: dict
    constexprs: dict
    options: dict

    def key(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @property
    def label(self) -> str:
        shown = {k: v for k, v in self.constexprs.items() if k not in INTERPRETER_FLAGS}
        return f"{self.kernel} {shown} {self.options}"


# ---- 1. recording, in the interpreter ----------------------------------------------------------------------------

def _argument_type(kernel: str, name: str, value) -> str:
    if isinstance(value, torch.Tensor):
        return "*" + POINTER_TYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"{kernel}: argument {name} of type {type(value).__name__} has no compile-time type here")


def _as_launch(fn, args: tuple, kwargs: dict) -> Launch:
    """The ``Launch`` of ``fn(*args, **kwargs)``: arguments bound to its parameters (defaults applied), the rest
    of ``kwargs`` launch options."""
    params = inspect.signature(fn).parameters
    bound = inspect.signature(fn).bind(*args, **{k: v for k, v in kwargs.items() if k in params})
    bound.apply_defaults()
    signature, constexprs = {}, {}
    for name, value in bound.arguments.items():
        if "constexpr" in str(fn.__annotations__.get(name, "")) or value is None:
            signature[name], constexprs[name] = "constexpr", value
        else:
            signature[name] = _argument_type(fn.__name__, name, value)
    options = {k: v for k, v in kwargs.items() if k not in params}
    return Launch(fn.__module__, fn.__name__, signature, constexprs, options)


def _drive_impls() -> None:
    """Plan and run small problems through every Triton path with the GPU's default configurations."""
    from impls.triton import decode, prefill_kernel, sparse_kernel
    from impls.triton.cache_ops import gather_cache_triton, has_kernel, write_cache_triton
    from impls.triton.chunked import TritonChunkedPrefill
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
            configs = {decode.default_config(heads, q_len, layout, page_size, keys_per_sm)
                       for heads in (16, 32, 64, 128) for q_len in (1, 2, 4) for keys_per_sm in (0.0, 1e9)}
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

    for layout, code in LAYOUT_CODES.items():
        for mode in ("sparse_decode", "sparse_prefill"):
            for impl, transform in ((TritonSparse, "paged"), (TritonSparseRagged, "ragged")):
                problem = build_problem(Workload(mode=mode, q_lens=(2, 1), kv_lens=(70, 33), page_size=16,
                                                 layout=layout, topk=32, index_transform=transform), cpu)
                for heads in (16, 64, 128):
                    runner = impl(sparse_kernel.default_config(gpu, heads, code))
                    runner.run(runner.plan(problem))
        chunked = TritonChunkedPrefill(prefill_kernel.default_config(gpu))
        problem = build_problem(Workload(mode="chunked_prefill", q_lens=(3, 2), kv_lens=(40, 9), page_size=16,
                                         layout=layout, chunk_size=16), cpu)
        chunked.run(chunked.plan(problem))
    prefill = TritonPrefill(prefill_kernel.default_config(gpu))
    prefill.run(prefill.plan(build_problem(Workload(mode="prefill", q_lens=(5, 3), kv_lens=(5, 3)), cpu)))
    parts = [(torch.randn(3, 4, 512), torch.randn(3, 4)) for _ in range(2)]
    merge_attn_states(*parts[0], *parts[1])
    rescale_partial(parts[0][0], torch.stack([lse for _, lse in parts]), rank=1)


@contextlib.contextmanager
def recorded_launches():
    """Within the block, interpreted kernel launches are recorded instead of executed: yields the ``Launch``
    objects, one per distinct launch, in order."""
    from triton.runtime.interpreter import InterpretedFunction

    recorded: list[Launch] = []
    keys: set[str] = set()

    def run_recorded(self, *args, grid, warmup, **kwargs):
        launch = _as_launch(self.fn, args, kwargs)
        if launch.key() not in keys:
            keys.add(launch.key())
            recorded.append(launch)

    executed = InterpretedFunction.run
    InterpretedFunction.run = run_recorded
    try:
        yield recorded
    finally:
        InterpretedFunction.run = executed


def write_launches(path: Path, launches: list[Launch]) -> None:
    path.write_text(json.dumps([dataclasses.asdict(launch) for launch in launches]))


# ---- 2. compiling, without the interpreter ------------------------------------------------------------------------

def gpu_variant(launch: Launch) -> Launch:
    """What a GPU compiles of a recorded launch: interpreter flags off, GPU-only flags on (their off state is the
    same code without the added calls)."""
    constexprs = {k: False if k in INTERPRETER_FLAGS else True if k in GPU_ONLY_FLAGS else v
                  for k, v in launch.constexprs.items()}
    return dataclasses.replace(launch, constexprs=constexprs)


def compile_launch(launch: Launch) -> str | None:
    """Compile ``launch`` for ``TARGET``; the error's last lines, or None when it compiles."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(launch.module), launch.kernel)
    try:
        source = ASTSource(kernel, dict(launch.signature), dict(launch.constexprs))
        triton.compile(source, target=GPUTarget(*TARGET), options=dict(launch.options))
    except Exception as error:  # noqa: BLE001 - any compiler failure is the finding
        return _innermost(error)
    return None


def _innermost(error: BaseException) -> str:
    """The deepest error of a chain (Triton wraps an error in a called function once per call level): its last
    lines, which show the source line, and the error under it when that has no source."""
    chain = [error]
    while chain[-1].__cause__ is not None:
        chain.append(chain[-1].__cause__)
    located = [e for e in chain if str(e).strip()]
    text = "\n".join(str(located[-1]).strip().splitlines()[-12:]) if located else ""
    return text if chain[-1] in located else f"{text}\n{chain[-1]!r}"


def compile_all(path: Path, workers: int) -> int:
    """Compile every GPU variant of the launches in ``path``; print failures; the number of failures."""
    import triton

    launches = {v.key(): v for v in (gpu_variant(Launch(**raw)) for raw in json.loads(path.read_text()))}
    ordered = sorted(launches.values(), key=lambda launch: launch.key())
    with ProcessPoolExecutor(max_workers=workers) as pool:
        errors = list(pool.map(compile_launch, ordered))
    failed = [(launch, error) for launch, error in zip(ordered, errors) if error]
    for launch, error in failed:
        print(f"FAILED {launch.label}\n{error}\n")
    print(f"Triton {triton.__version__}, sm_{TARGET[1]}: {len(ordered) - len(failed)} of {len(ordered)} kernel "
          f"launches compile")
    return len(failed)


# ---- the two processes ---------------------------------------------------------------------------------------------

def _phase(name: str, path: Path, interpret: bool, args: argparse.Namespace) -> int:
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    if args.triton_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.abspath(args.triton_path), env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", MODULE, f"--{name}", str(path), "--workers", str(args.workers)]
    return subprocess.run(command, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--triton-path", help="a directory holding another Triton, put first on the path")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--record", type=Path, help=argparse.SUPPRESS)  # phase 1, in its own process
    parser.add_argument("--compile", type=Path, help=argparse.SUPPRESS)  # phase 2, in its own process
    args = parser.parse_args(argv)
    if args.record:
        with recorded_launches() as launches:
            _drive_impls()
        write_launches(args.record, launches)
        return 0
    if args.compile:
        return 1 if compile_all(args.compile, args.workers) else 0
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "launches.json"
        return _phase("record", path, True, args) or _phase("compile", path, False, args)


if __name__ == "__main__":
    sys.exit(main())

"""Small pieces the Triton kernel modules here share, and two workarounds for Triton 3.9's interpreter.

- The interpreter multiplies bfloat16 tiles as their raw uint16 bits (``np.matmul`` on the storage), so under
  ``TRITON_INTERPRET=1`` the kernels feed ``tl.dot`` float32 copies of their bf16/fp16 tiles (``mma``). The
  products of two bf16 (or fp16) values are exact in float32, so this changes nothing but speed.
- The interpreter's float32 -> bfloat16 cast truncates where the GPU rounds to nearest even, which biases every
  rounded probability and output and roughly doubles the error the CPU tests see; ``cast`` rounds first.

On a GPU (the flag ``INTERP`` / ``UPCAST`` False) both are plain ``tl.dot`` and ``.to``.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime.interpreter import InterpretedFunction
from triton.runtime.jit import JITFunction

from mla_bench.errors import UnsupportedConfig, given
from mla_bench.layouts.ops import check_slots, check_slots_in_cache

INTERPRETING = bool(knobs.runtime.interpret)  # as triton.jit decides: "true" and "on" are on, "2" is off


def stale_kernels() -> str | None:
    """Why this process's Triton kernels cannot be trusted, or None. Triton makes a kernel compiled or interpreted
    when it is defined, from ``TRITON_INTERPRET`` or ``triton.knobs.runtime.interpret`` set from Python: a module of
    ours imported while an impl had changed either (the bench puts the variable back, not the kernels defined
    meanwhile, nor the knob) would run interpreted on a GPU, timed as if compiled, or compiled over CPU tensors. Gluon
    kernels are always compiled, so only ``triton.jit`` ones are read."""
    interpreting = bool(knobs.runtime.interpret)
    if interpreting != knobs.getenv_bool("TRITON_INTERPRET", False):
        return (f"triton.knobs.runtime.interpret is {interpreting} but TRITON_INTERPRET says otherwise: it was set "
                f"from Python (an impl that set it?); run again in a new process")
    stale = sorted(name for name, module in list(sys.modules.items())
                   if name.startswith("impls.triton") and module is not None
                   and any(_defined_otherwise(value, interpreting) for value in vars(module).values()))
    if not stale:
        return None
    return (f"the Triton kernels of {', '.join(stale)} were defined {'compiled' if interpreting else 'interpreted'} "
            f"but Triton {'interprets' if interpreting else 'compiles'} now: TRITON_INTERPRET changed while they were "
            f"imported (an impl that set it?); run again in a new process")


def _defined_otherwise(value: object, interpreting: bool) -> bool:
    """Whether ``value`` is a ``triton.jit`` kernel defined under the other setting (Gluon's subclass is excluded)."""
    return type(value) in (InterpretedFunction, JITFunction) and isinstance(value, InterpretedFunction) != interpreting


def has_wgmma(device: torch.device) -> bool:
    """Hopper's warpgroup MMA, which the Gluon kernels (``decode_wgmma``, ``decode_wgmma_narrow``,
    ``decode_wgmma_fp8``, ``sparse_wgmma``) issue (``decode_mma_fp8``, mma.sync, is tested on Hopper only): CUDA
    devices of compute capability 9 (Blackwell's tensor cores take other instructions)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9


def sm_count(device: torch.device) -> int:
    """Multiprocessors a split-KV kernel fills; the interpreter gets a nominal 4 so that small tests still split."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Make ``device`` the current CUDA device for the block: Triton compiles for and launches on the current device
    whatever its tensors' device, so tensors on cuda:1 while cuda:0 is current ran cuda:0's kernels over cuda:1's
    memory. A no-op for the CPU and for ``cuda`` without an index (the current device). Host-side only (no
    synchronization, no allocation): it may be entered while a CUDA graph is captured. The public functions that
    launch kernels enter it, called as ``common.on_device`` (the tests watch it there)."""
    if device.type == "cuda" and device.index is not None:
        return torch.cuda.device(device)
    return contextlib.nullcontext()


def misplaced(device: torch.device, where: str, **tensors: torch.Tensor) -> list[str]:
    """One message per tensor of ``tensors`` not on ``device`` (``where``: what is there, e.g. ``"q"``), and one if
    ``device`` is the meta device, which holds no values (the launch failed inside Triton); ``cuda`` without an index
    is the current GPU, where the kernels launch. A kernel reads another device's tensor as an address on its own: a
    failed launch, an illegal memory access or another tensor's values, so plans refuse it."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    on_meta = [f"{where} is on the meta device, which holds no values"] if device.type == "meta" else []
    return on_meta + [f"{name} is on {tensor.device} but {where} is on {device}" for name, tensor in tensors.items()
                      if tensor.device != device]


def overlapping(tensor: torch.Tensor) -> bool:
    """Whether two elements of ``tensor`` may share memory (a stride of 0, as ``expand`` makes, or a stride shorter
    than the span of the dims it steps over): a kernel writing it races, and each shared element keeps one row's
    value. Host-only: strides and sizes. Conservative: an interleaving of dims is taken as overlap."""
    span = 1  # elements the dims so far reach
    for stride, size in sorted((s, n) for s, n in zip(tensor.stride(), tensor.shape) if n > 1):
        if stride < span:
            return True
        span = stride * (size - 1) + span
    return False


def overlap_problems(**outputs: torch.Tensor) -> list[str]:
    """One message per tensor of ``outputs`` whose elements overlap (``overlapping``)."""
    return [f"{name} must not overlap itself (strides {list(t.stride())} for shape {list(t.shape)})"
            for name, t in outputs.items() if overlapping(t)]


def check_placed_outputs(who: str, first: str, device: torch.device, inputs: dict[str, torch.Tensor],
                         **outputs: torch.Tensor) -> None:
    """ValueError, prefixed ``who``, naming each of ``inputs`` and ``outputs`` off ``device`` (input ``first``'s,
    where the kernel runs) and each of ``outputs`` whose elements overlap (``overlapping``)."""
    problems = misplaced(device, first, **inputs, **outputs) + overlap_problems(**outputs)
    if problems:
        raise ValueError(f"{who}: " + "; ".join(problems))


def output_problems(out: torch.Tensor | None, lse: torch.Tensor | None, tokens: int, heads: int,
                    dim: int) -> list[str]:
    """One message per given ``out`` that is not floating point ``[tokens, heads, dim]`` with its last dim contiguous,
    or ``lse`` not float32 ``[tokens, heads]``, or either overlapping itself: a kernel writes them as such (an int out
    and an int or bf16 lse were truncated)."""
    problems = []
    if out is not None and (tuple(out.shape) != (tokens, heads, dim) or out.stride(-1) != 1
                            or not out.dtype.is_floating_point):
        problems.append(f"out must be [{tokens}, {heads}, {dim}] floating point (last dim contiguous), got "
                        f"{out.dtype} {list(out.shape)} strides {out.stride()}")
    if lse is not None and (tuple(lse.shape) != (tokens, heads) or lse.dtype != torch.float32):
        problems.append(f"lse must be [{tokens}, {heads}] float32, got {lse.dtype} {list(lse.shape)}")
    return problems + overlap_problems(**given(out=out, lse=lse))


def check_placed(device: torch.device, where: str, **tensors: torch.Tensor) -> None:
    """ValueError joining ``misplaced``'s messages, where any tensor is off ``device``."""
    if wrong := misplaced(device, where, **tensors):
        raise ValueError("; ".join(wrong))


def check_token_slots(problem) -> None:
    """ValueError unless ``meta.token_slots`` (the ragged paths' gather) and the cache are on the problem's device,
    where the gather runs, and the slots are one per key, each a slot of the cache: the gather reads a slot outside
    it as another token's row (or past the cache), and skips the rows a short list lacks. Reads the slots' range
    on the host."""
    meta = problem.meta
    check_placed(problem.device, "the problem", token_slots=meta.token_slots, cache=problem.cache.data)
    check_slots("token_slots", meta.token_slots, sum(meta.kv_lens))
    check_slots_in_cache("token_slots", meta.token_slots, problem.cache.num_slots)


def check_power_of_two(config: object, name: str, least: int = 1) -> None:
    """ValueError unless ``config``'s field ``name`` is an int power of two of at least ``least``: a tile or warp
    count Triton cannot build fails only at the first launch, inside Triton, and some only on a GPU."""
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < least or value & (value - 1):
        floor = f" >= {least}" if least > 1 else ""
        raise ValueError(f"{type(config).__name__}.{name} must be a power of two{floor}, got {value!r}")


E4M3_LAYOUTS = frozenset({"fp8_e4m3", "fp8_ds_mla", "fp8_ds_mla_pow2", "nvfp4"})  # codes or scales read as e4m3


def check_e4m3(device: torch.device, layout: str, who: str) -> None:
    """The kernels read these layouts' e4m3 bytes as ``tl.float8e4nv``, which Triton compiles for compute capability
    8.9 and newer only (before, the kernel fails at its first launch): UnsupportedConfig in plan instead."""
    if layout in E4M3_LAYOUTS and device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise UnsupportedConfig(f"{who}: layout {layout!r} is read as e4m3, which Triton compiles for compute "
                                f"capability 8.9 and newer, not {device}'s {torch.cuda.get_device_capability(device)}")


@triton.jit
def mma(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` with float32 accumulation (operands upcast when ``UPCAST``: the interpreter)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    return tl.dot(a, b, acc)


@triton.jit
def cast(x, DTYPE: tl.constexpr, INTERP: tl.constexpr):
    """``x.to(DTYPE)`` rounding to nearest even, also in the interpreter (whose fp32 -> bf16 cast truncates)."""
    if INTERP:
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            x = (bits & 0xFFFF0000).to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def prefetch_l2(ptrs, INTERP: tl.constexpr):
    """Request the cache lines holding ``ptrs`` into L2, without a result to wait for: a hint that starts a DRAM
    read a later load of the loop will need (skipped by the interpreter, which has no inline assembly)."""
    if not INTERP:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)

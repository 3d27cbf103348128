"""Attention for decoding on a CPU (bf16 and fp32), RoPE with the cache write, the
residual add with its RMSNorm, the greedy token of each row of logits (and of an fp32
lm_head screened through a bf16 one: greedy_head.py), (in bf16) the MLP's SiLU with its
product, and (in fp32, on AVX2 CPUs without AVX-512) products of a few rows, in C++
(cpu_kernels.cpp).

A decoding step attends a few new tokens per row (one, or a draft tree's nodes) over that
row's cache. torch's CPU kernels do this badly: in bf16 its flash kernel took 14.5 ms a
layer at 64 rows x 330 slots on the AVX512-BF16 EPYC, where reading those keys and values
takes about 1 ms; in fp32 it turns the mask into a dense float bias and took twice this
kernel's time at 80 rows x 1 token on the AVX2 EPYC. This kernel reads each key and value
once, serves every query head that shares a key (GQA) from there, reads each row only up
to its own last visible slot, and keeps scores, softmax and the weighted sum in fp32
(bf16 pairs multiplied by vdpbf16ps where the CPU has it; fp32 with AVX-512 FMA, or
AVX2 on CPUs without it: the 16-lane loops cut an 80-row fp32 step's attention from 44
to 37 ms on the AVX512-BF16 EPYC, where its keys and values take ~22 ms to read; the AVX2
loops' weighted sum, 3 query rows x 32 outputs in registers where it took 16 in four
passes over the values, from 64 to 51 ms on the Zen 3 EPYC). In bf16
many new tokens (a prefill) go in blocks, so it serves those too (1.4-2.3x torch's bf16
SDPA, 4 to 400 tokens); in fp32 it does where its vector loops serve the head size
(a multiple of 16: the 80 MT-bench prompts' prefill took 3.5 s against SDPA's 4.1-4.3 s
on the 2-core Zen 5 EPYC; the AVX2 loops took 0.64-0.86x SDPA's time for prefill groups
of 1-80 rows on the Zen 3 EPYC), and elsewhere up to FP32_TOKENS per row. Around it, in
bf16, torch spends a dozen small ops a layer on RoPE, the cache write, the residual add
and RMSNorm, each a pass over the rows: `rope_attend` and `add_rms_norm` do them in one,
rounding each step as those ops do (BENCHMARKS.md, "bf16 kernels").

fp32 sums in another order than torch's SDPA, so its last bits differ; greedy output
stays token-identical to transformers' `generate` as before (the identity tests, and
the 80 MT-bench prompts against vLLM in BENCHMARKS.md), just as a batched product already
rounds differently from a one-row one.

It is compiled on first use (torch's cpp_extension, cached per source, CPU, torch and
Python): the kernels and their Python bindings (cpu_kernels_bindings.cpp) side by side,
13 s on the 2-core Zen 4 EPYC, where one file including torch/extension.h took 38 s.
Later processes import the built module directly, without cpp_extension and the
setuptools it imports (~0.2 s of every start). Where no compiler is at hand `kernel()` is
None and llama.py keeps torch's ops.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path
from types import ModuleType

import torch

# The kernels, and their Python bindings apart (a second compiler beside the first)
SOURCES = [
    Path(__file__).with_name(name) for name in ("cpu_kernels.cpp", "cpu_kernels_bindings.cpp")
]


@cache
def _cpu_tag() -> str:
    """What the compiled code depends on: -march=native ties it to this CPU's flags, and
    the build to the torch and the Python it was compiled against. The torch's location
    counts too: a build directory shared by two virtualenvs was rebuilt, silently, each
    time the other one loaded it (~25 s on the 2-core Xeon)."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = line
                break
    except OSError:
        pass
    built_against = torch.__version__ + str(Path(torch.__file__).parent) + sys.version
    code = "".join(source.read_text() for source in SOURCES)
    return hashlib.sha256((code + flags + built_against).encode()).hexdigest()[:16]


def _build_directory(name: str) -> Path:
    """Where the module is built and found: under TORCH_EXTENSIONS_DIR, else the user's
    torch_extensions cache (where torch's cpp_extension builds by default)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        cache_home = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
        root = Path(cache_home) / "torch_extensions"
    return Path(root) / name


def _import_built(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _built(name: str, path: Path) -> ModuleType | None:
    """The module built at `path`, or None: not built, or a build cut short."""
    if not path.is_file():
        return None
    try:
        return _import_built(name, path)
    except ImportError:
        return None


@contextmanager
def _builder(directory: Path) -> Iterator[None]:
    """This process alone builds in `directory` while inside: a lock the system drops when
    its process dies. Inside, torch's own lock file is gone: a build killed mid-compile
    (SIGTERM, SIGKILL, the OOM killer) leaves it, and torch's next build of the same
    source then waits on it forever, saying only "compiling"."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "build.flock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield


def _compile(name: str, directory: Path) -> ModuleType:
    from torch.utils.cpp_extension import load

    print(
        "compiling the CPU kernels (once per machine and torch install, under a minute)",
        file=sys.stderr,
        flush=True,
    )
    return load(
        name=name,
        sources=[str(source) for source in SOURCES],
        extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"],
        build_directory=str(directory),
    )


@cache
def kernel() -> ModuleType | None:
    """The compiled module, or None where it cannot be built here (said once). One process
    builds at a time; the others wait, then load what it built."""
    name = f"eagle2_cpu_kernels_{_cpu_tag()}"
    directory = _build_directory(name)
    built = directory / f"{name}.so"
    module = _built(name, built)
    if module is not None:
        return module
    try:
        with _builder(directory):
            return _built(name, built) or _compile(name, directory)
    except Exception as error:  # no compiler, ninja or headers: torch's kernel instead
        print(f"CPU kernels unavailable, using torch's: {error}", file=sys.stderr)
        return None


def build() -> str | None:
    """Which kernels this process runs: the compiled module's tag (its source, this CPU's
    flags, torch and Python), or None where torch's ops stand in. What a forward costs
    depends on it (cost.py keys its table by it)."""
    return _cpu_tag() if kernel() is not None else None


FP32_TOKENS = 4  # new tokens per row up to which fp32 without vector loops takes the kernel


@cache
def _avx2() -> bool:
    """Whether this CPU runs AVX2 (the kernels build for it: -march=native; so does every
    AVX-512 CPU)."""
    return torch.cpu._is_avx2_supported()


ROWS_LINEAR_ROWS = 8  # rows up to which `rows_linear` beats oneDNN (AVX2 EPYC, 1-8 rows)


@cache
def _avx512() -> bool:
    return torch.cpu._is_avx512_supported()


def multiplies_rows(weight: torch.Tensor) -> bool:
    """Whether `rows_linear` takes products of a few rows with this weight: fp32 on a CPU
    with AVX2 but not AVX-512, where the kernels compiled. There oneDNN's prepacked
    products stream the weights at 9-16 GB/s for 1-8 rows, this kernel at 15-21 (a 2-core
    Zen 3 EPYC reading ~22 GB/s; BENCHMARKS.md). AVX-512 CPUs keep oneDNN (~21 of ~31
    GB/s on a Zen 4 EPYC): this kernel has not been measured there."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and _avx2()
        and not _avx512()
        and kernel() is not None
    )


def pack_rows(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] as `rows_linear` reads it: [ceil(N / 16), K, 16], 16 outputs' weights
    side by side (the last block padded with zeros), in one pass over the weight."""
    n, k = weight.shape
    blocks = -(-n // 16)
    if n % 16:
        weight = torch.cat([weight, weight.new_zeros(blocks * 16 - n, k)])
    return weight.reshape(blocks, 16, k).transpose(1, 2).contiguous()


def rows_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int
) -> torch.Tensor:
    """x [R, K] (fp32, a few rows) times the weight `pack_rows` packed, of n outputs, plus
    bias: [R, n], as F.linear but summed in another order (for one or two rows the even
    and the odd k apart, then added), so the last bits can differ."""
    return kernel().rows_linear(x, packed, bias, n)


def norms(x: torch.Tensor) -> bool:
    """Whether `add_rms_norm` takes x's residual add and RMSNorm: bf16 or fp32 on a CPU,
    where the kernels compiled."""
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.bfloat16, torch.float32)
        and kernel() is not None
    )


def attends(x: torch.Tensor, tokens: int, head_dim: int) -> bool:
    """Whether `rope_attend` takes the attention of x [B, T, ...] with `tokens` new tokens
    per row of head_dim: bf16 on a CPU always; fp32 with AVX2 (or AVX-512) and a head
    size that is a multiple of 16 always (a prefill too: 3.5 s against SDPA's 4.1-4.3 s
    for the 80 MT-bench prompts on the Zen 5 EPYC; 0.64-0.86x SDPA's time for prefill
    groups on the Zen 3 EPYC, BENCHMARKS.md); else, in the plain loops, for up to
    FP32_TOKENS (a plain decoding step, a small tree), where torch's SDPA takes a mask as
    a dense float bias and loops over every row and head."""
    if not norms(x):
        return False
    if x.dtype == torch.bfloat16 or tokens <= FP32_TOKENS:
        return True
    return head_dim % 16 == 0 and _avx2()


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + delta, its RMSNorm) in one pass over the rows (x alone where delta is None),
    rounded as torch rounds `x + delta` and F.rms_norm in x's dtype (fp32 sums the
    squares in its own order)."""
    total, normed = kernel().add_rms_norm(x, delta, weight, eps)  # the binding gives a list
    return total, normed


# keys, values [kv_heads, P, D] and lens [B]: a shared prefix as one layer's attention reads it
Prefix = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
_NO_PREFIX = (None, None, None)


def rope_attend(
    mixed: torch.Tensor,
    angles: tuple[torch.Tensor, torch.Tensor],
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: torch.Tensor,
    mask: torch.Tensor,
    heads: int,
    prefix: Prefix | None = None,
) -> torch.Tensor:
    """An attention block's middle in one call: RoPE (cos, sin [B, T, 1, D]) on the
    queries and keys of mixed [B, T, (heads + 2 kv_heads) * D], the new keys and values
    written to slots [B, T] of the cache [B, kv_heads, capacity, D], attention over the
    first mask.shape[-1] slots; [B, T, heads * D]. Each step rounds as llama.rotate, the
    cache writes and decode_attention do one after the other, in fewer passes. `prefix`:
    see decode_attention."""
    cos, sin = angles
    return kernel().rope_attend(
        mixed, cos[:, :, 0], sin[:, :, 0], keys, values, slots, mask[:, 0].contiguous(),
        heads, keys.shape[-1] ** -0.5, *(prefix or _NO_PREFIX),
    )  # fmt: skip


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [..., 2I] (gate | up): in bf16 on a CPU one pass in the
    kernel, where torch's chunk, SiLU and product took ~3 ms of a 107 ms round at 77 rows
    (BENCHMARKS.md); a result can differ from torch's by one bf16 ulp (its exp is another
    polynomial). fp32 keeps torch's ops: its greedy output stays that of `generate`."""
    if gate_up.dtype == torch.bfloat16 and norms(gate_up):
        return kernel().silu_mul(gate_up)
    return torch_silu_mul(gate_up)


def torch_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up in torch's own ops: what `silu_mul` does without the kernel. The
    product goes into SiLU's result (the same values, one buffer and one pass fewer): an
    fp32 prefill's 8,000 tokens took 23 ms a layer instead of 38 on the AVX512-BF16 EPYC
    (gradients are the same: autograd keeps what the product needs)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate).mul_(up)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax over the last dimension (the first maximum; the first NaN where
    there is one), as `logits.max(dim=-1).indices` gives it: in the kernel on a CPU, where
    torch's max with indices took 2.3-2.8 ms for 77 rows of bf16 logits against ~0.4 ms
    for the peak alone (BENCHMARKS.md)."""
    if norms(logits):
        return kernel().row_argmax(logits)
    return logits.max(dim=-1).indices


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    prefix: Prefix | None = None,
) -> torch.Tensor:
    """q [B, T, heads, D] (as the q|k|v product lays it out) over keys, values
    [B, kv_heads, S, D] (bf16 or fp32, as q) where mask [B, 1, T, S] is True;
    [B, T, heads * D], what the output projection takes. Each row reads its slots up to
    its last visible one, so rows of different lengths need no chunking. `prefix`: keys and
    values [kv_heads, P, D] that row b's first lens[b] slots hold too (int64 [B]), read
    there by the vector kernels: one copy for every row, in cache, not one each from
    memory; the result is the same bits."""
    return kernel().decode_attention(
        q, keys, values, mask[:, 0].contiguous(), q.shape[-1] ** -0.5, *(prefix or _NO_PREFIX)
    )

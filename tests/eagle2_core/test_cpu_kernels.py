"""The CPU kernels against torch's own ops: attention, RoPE with the cache write, the
residual add with RMSNorm, the greedy token, SiLU with the product and products of a few
rows; and how a built module loads and how builders take turns."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import pytest
import torch

from eagle2_core import cpu_kernels
from eagle2_core.llama import rotate


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("vocab", [1, 15, 16, 49152, 49157])
def test_greedy_tokens_are_torchs_first_maximum(dtype, vocab):
    """Random rows, exact ties (the first wins), -inf masks, NaN (the first NaN wins, as
    torch.max gives it), three dimensions and a strided view: indices equal max's."""
    assert cpu_kernels.kernel() is not None  # CI's machine has a compiler
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(6, 3, vocab, generator=generator).to(dtype)
    logits[0, 0] = 2.0  # every entry ties
    logits[1, 1] = float("-inf")
    logits[1, 2, vocab // 2 :] = float("-inf")
    if vocab > 1:
        logits[2, 0, [vocab // 3, vocab - 1]] = 50.0  # a tie late in the row
        logits[3, 1, [vocab - 1, vocab // 2]] = float("nan")
        logits[4, 2, :] = torch.finfo(dtype).min
        logits[4, 2, vocab - 1] = float("inf")
    for case in (logits, logits[:, 1:], logits.transpose(0, 1)):
        want = case.max(dim=-1).indices
        got = cpu_kernels.greedy_tokens(case)
        assert got.dtype == torch.long and got.shape == want.shape
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_is_torchs_within_a_bf16_ulp(dtype):
    """The MLP's middle: fp32 exactly torch's ops; bf16 equal to F.silu(gate) * up but for
    rare single-ulp differences (another exp polynomial), with extremes that overflow
    exp or sit at zero."""
    generator = torch.Generator().manual_seed(0)
    gate_up = (torch.randn(37, 2, 2 * 1536, generator=generator) * 4).to(dtype)
    gate_up[0, 0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    assert torch.equal(cpu_kernels.torch_silu_mul(gate_up), want)
    got = cpu_kernels.silu_mul(gate_up)
    assert got.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        assert torch.equal(got, want)
        return
    assert cpu_kernels.kernel() is not None
    differ = got != want
    assert differ.float().mean() < 1e-3
    ulp = (got.float() - want.float()).abs() / want.float().abs().clamp(min=1e-30)
    assert (ulp[differ] <= 2**-7).all()  # one bf16 ulp: 8 bits of mantissa


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [16, 24, 64, 128])  # vector: fp32 16 | D or 64 | D, bf16 64 | D
@pytest.mark.parametrize("tokens", [1, 3, 7])  # 7: two blocks of new tokens (16 // 3 = 5)
def test_the_cpu_attention_kernel_is_attention_over_the_masked_slots(tokens, dim, dtype):
    """Against float64 SDPA: GQA heads mapped as transformers maps them (query head h reads
    KV head h // group), masked slots invisible, slot counts not a multiple of its blocks,
    a cache slice with its capacity's strides, q a strided view as the q|k|v product
    leaves it; only slot 0 visible gives its value."""
    assert cpu_kernels.kernel() is not None  # CI's machine has a compiler
    torch.manual_seed(0)
    q = torch.randn(3, tokens, 8, dim).to(dtype)[:, :, :6]  # [B, T, heads, D], strided
    keys, values = torch.randn(3, 2, 2, 40, dim).to(dtype)[:, :, :, :35].unbind(1)
    mask = torch.rand(3, 1, tokens, 35) > 0.4
    mask[..., 0] = True
    mask[1, ..., 19:] = False  # a shorter row
    expected = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).double(), keys.double(), values.double(), attn_mask=mask,
        enable_gqa=True,
    ).transpose(1, 2).reshape(3, tokens, 6 * dim)  # fmt: skip
    assert cpu_kernels.norms(q)
    vector = dim % 16 == 0 and torch.cpu._is_avx2_supported()
    assert cpu_kernels.attends(q, tokens, dim) == (dtype == torch.bfloat16 or tokens <= 4 or vector)
    got = cpu_kernels.decode_attention(q, keys, values, mask)
    assert got.dtype == dtype and got.shape == (3, tokens, 6 * dim)
    assert torch.allclose(got.double(), expected, atol=1e-2 if dtype == torch.bfloat16 else 1e-5)
    mask[..., 1:] = False
    got = cpu_kernels.decode_attention(q, keys, values, mask).view(3, tokens, 6, dim)
    first = values[:, :, 0].repeat_interleave(3, dim=1)[:, None].expand(3, tokens, 6, dim)
    assert torch.equal(got, first)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("dim", [16, 64])
@torch.inference_mode()
def test_the_fused_block_equals_rope_then_the_cache_write_then_the_kernel(dim, dtype):
    """rope_attend rounds as llama.rotate does and writes each new key and value to its
    own row's slot: in bf16 the same bits as the three steps one after the other; in fp32
    (where the compiler may fuse RoPE's multiply and add) within an fp32 rounding."""
    torch.manual_seed(0)
    b, t, heads, kv_heads, capacity = 3, 2, 6, 2, 24
    mixed = torch.randn(b, t, (heads + 2 * kv_heads) * dim).to(dtype)
    angles = [torch.randn(b, t, 1, dim).to(dtype) for _ in range(2)]
    keys, values = torch.randn(2, b, kv_heads, capacity, dim).to(dtype)
    lengths = torch.tensor([5, 9, 7])
    slots = lengths[:, None] + torch.arange(t)
    span = int(slots.max()) + 1
    positions = torch.arange(span)[None, None]
    mask = ((positions < lengths[:, None, None]) | (positions == slots[:, :, None]))[:, None]
    mask[0, 0, 1, slots[0, 0]] = True  # the second new token sees the first

    qk = rotate(mixed[..., : (heads + kv_heads) * dim].view(b, t, -1, dim), *angles)
    v = mixed[..., (heads + kv_heads) * dim :].view(b, t, kv_heads, dim)
    want_keys, want_values = keys.clone(), values.clone()
    rows = torch.arange(b)[:, None]
    want_keys.transpose(1, 2)[rows, slots] = qk[:, :, heads:]
    want_values.transpose(1, 2)[rows, slots] = v
    want = cpu_kernels.decode_attention(
        qk[:, :, :heads], want_keys[:, :, :span], want_values[:, :, :span], mask
    )
    got = cpu_kernels.rope_attend(mixed, angles, keys, values, slots, mask, heads)

    def same(a: torch.Tensor, b: torch.Tensor) -> bool:
        return torch.equal(a, b) if dtype == torch.bfloat16 else torch.allclose(a, b, atol=1e-6)

    assert same(got, want) and same(keys, want_keys) and torch.equal(values, want_values)


def _reads_prefix(dtype: torch.dtype) -> bool:
    """Whether a vector attention kernel (those read a shared prefix; the plain loops do
    not) runs `dtype` here: fp32 needs AVX2 and FMA, bf16 AVX512-BF16."""
    flags = Path("/proc/cpuinfo").read_text().split()
    if dtype == torch.float32:
        return "avx2" in flags and "fma" in flags
    return "avx512_bf16" in flags


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("length", [30, 16, 5])
def test_a_shared_prefix_is_read_there_and_gives_the_same_bits(length, tokens, dtype):
    """Rows whose first slots hold a shared prefix (all of it, part of it, or none) give
    the same bits reading it from the prefix as from their own copies; the vector kernels
    do read it there (poisoned copies change nothing). A row said to hold more of it
    than it has is refused."""
    torch.manual_seed(1)
    b, kv_heads, capacity = 5, 3, 80
    keys, values = torch.randn(2, b, kv_heads, capacity, 64).to(dtype)
    prefix_keys, prefix_values = torch.randn(2, kv_heads, 40, 64).to(dtype)[:, :, :length]
    holds = [length, 0, length, length // 2, length]
    for row, n in enumerate(holds):
        keys[row, :, :n], values[row, :, :n] = prefix_keys[:, :n], prefix_values[:, :n]
    q = torch.randn(b, tokens, 9, 64).to(dtype)
    lens = torch.tensor([70, 45, length + tokens, 50, 66])[:, None, None]
    mask = torch.arange(capacity)[None, None] < lens - tokens + 1 + torch.arange(tokens)[:, None]
    mask = mask[:, None]
    prefix = (prefix_keys, prefix_values, torch.tensor(holds))
    own = cpu_kernels.decode_attention(q, keys, values, mask)
    assert torch.equal(cpu_kernels.decode_attention(q, keys, values, mask, prefix), own)
    if _reads_prefix(dtype):
        for row, n in enumerate(holds):
            keys[row, :, :n], values[row, :, :n] = 1e4, -1e4
        assert torch.equal(cpu_kernels.decode_attention(q, keys, values, mask, prefix), own)
    with pytest.raises(RuntimeError, match="row 1 holds 41 slots of a prefix of"):
        cpu_kernels.decode_attention(
            q, keys, values, mask, (prefix_keys, prefix_values, torch.tensor([0, 41, 0, 0, 0]))
        )


@pytest.mark.parametrize("with_delta", [True, False])
def test_the_fused_bf16_norm_is_the_sum_and_torchs_rms_norm(with_delta):
    """The residual sum bit for bit as torch adds in bf16; the norm within one bf16 step
    of F.rms_norm (its fp32 sum of squares is added up in another order)."""
    torch.manual_seed(0)
    x, delta = (torch.randn(2, 37, 576) * 3).bfloat16()
    weight = torch.rand(576).bfloat16() + 0.5
    total, normed = cpu_kernels.add_rms_norm(x, delta if with_delta else None, weight, 1e-5)
    want_total = x + delta if with_delta else x
    assert torch.equal(total, want_total)
    want = torch.nn.functional.rms_norm(want_total, (576,), weight, 1e-5)
    steps = (normed.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)
    assert float(steps.max()) <= 2**-7  # one bf16 step at most
    assert float((normed != want).float().mean()) < 0.01


@pytest.mark.parametrize("with_delta", [True, False])
def test_the_fused_fp32_norm_is_the_sum_and_torchs_rms_norm(with_delta):
    """In fp32 the residual sum is torch's bit for bit and the norm within a few fp32
    roundings of F.rms_norm."""
    torch.manual_seed(0)
    x, delta = torch.randn(2, 2, 37, 576) * 3
    weight = torch.rand(576) + 0.5
    total, normed = cpu_kernels.add_rms_norm(x, delta if with_delta else None, weight, 1e-5)
    want_total = x + delta if with_delta else x
    assert torch.equal(total, want_total)
    want = torch.nn.functional.rms_norm(want_total, (576,), weight, 1e-5)
    torch.testing.assert_close(normed, want, rtol=1e-6, atol=1e-6)


few_rows = pytest.mark.skipif(
    not torch.cpu._is_avx2_supported(), reason="rows_linear is AVX2 code: never run without it"
)
# (outputs, inputs): a last block of fewer than 16 outputs, an odd K, SmolLM2's q|k|v
ROWS_SHAPES = [(48, 20), (37, 9), (5, 3), (960, 576)]


@few_rows
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 7, 9, 13])
@pytest.mark.parametrize("shape", ROWS_SHAPES)
@pytest.mark.parametrize("with_bias", [True, False])
def test_few_rows_products_are_exact_where_every_order_is(rows, shape, with_bias):
    """Small integers sum exactly in any order, so every output, row and bias must be
    torch's bit for bit: a product or a block out of place cannot hide."""
    n, k = shape
    g = torch.Generator().manual_seed(rows * n + k)
    weight = torch.randint(-8, 9, (n, k), generator=g).float()
    x = torch.randint(-8, 9, (rows, k), generator=g).float()
    bias = torch.randint(-8, 9, (n,), generator=g).float() if with_bias else None
    got = cpu_kernels.rows_linear(x, cpu_kernels.pack_rows(weight), bias, n)
    assert torch.equal(got, torch.nn.functional.linear(x, weight, bias))


@few_rows
@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("shape", ROWS_SHAPES)
def test_few_rows_products_round_within_fp32s_bound(rows, shape):
    """On real numbers the sums go in another order than torch's: each output stays
    within the bound of any fp32 summation order, K units of rounding of sum |x w|."""
    n, k = shape
    g = torch.Generator().manual_seed(rows + n)
    weight, x = torch.randn(n, k, generator=g), torch.randn(rows, k, generator=g)
    got = cpu_kernels.rows_linear(x, cpu_kernels.pack_rows(weight), None, n)
    exact = x.double() @ weight.double().T
    bound = k * 2.0**-24 * (x.double().abs() @ weight.double().abs().T)
    assert bool(((got.double() - exact).abs() <= bound).all())


def test_a_built_kernel_loads_without_torchs_build_tools():
    """Once built, a process imports the kernel module itself: no cpp_extension and the
    setuptools it pulls in (~0.2 s of every start)."""
    assert cpu_kernels.kernel() is not None  # built here, if not before
    code = (
        "import sys; from eagle2_core import cpu_kernels; "
        "assert cpu_kernels.kernel() is not None; "
        "print('torch.utils.cpp_extension' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"
    assert "compiling" not in done.stderr


def test_a_builder_killed_mid_compile_blocks_no_later_build(tmp_path):
    """A process killed while it builds (here SIGKILL, inside the build lock, with torch's
    lock file made as torch makes it) leaves that file; the next builder still gets in at
    once, and without it: torch's next build would otherwise wait on it forever."""
    from torch.utils.file_baton import FileBaton

    code = (
        "import sys, time; from pathlib import Path; from eagle2_core import cpu_kernels\n"
        "with cpu_kernels._builder(Path(sys.argv[1])):\n"
        "    (Path(sys.argv[1]) / 'lock').touch(); print('building', flush=True); time.sleep(60)"
    )
    builder = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE)
    assert builder.stdout.readline() == b"building\n"
    builder.kill()
    builder.wait()
    assert (tmp_path / "lock").exists()
    with cpu_kernels._builder(tmp_path):
        assert not (tmp_path / "lock").exists()
        baton = FileBaton(str(tmp_path / "lock"))
        assert baton.try_acquire()  # torch's build would go ahead
        baton.release()


def test_a_second_builder_waits_for_the_first(tmp_path):
    """Two processes never build in one directory at once: the second waits until the
    first is done (then finds its module, in `kernel`)."""
    code = (
        "import sys; from pathlib import Path; from eagle2_core import cpu_kernels\n"
        "with cpu_kernels._builder(Path(sys.argv[1])):\n"
        "    print('building', flush=True); sys.stdin.readline()"
    )
    first = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert first.stdout.readline() == b"building\n"
    inside = threading.Event()

    def second() -> None:
        with cpu_kernels._builder(tmp_path):
            inside.set()

    waiter = threading.Thread(target=second)
    waiter.start()
    assert not inside.wait(0.5)
    first.communicate(b"done\n")
    assert inside.wait(10)
    waiter.join()


def test_the_source_compiles_for_every_instruction_set():
    """The module is built with -march=native, so a machine compiles only its own branches
    of the source: a duplicate helper in the AVX-512 branch once broke the build on every
    AVX-512 machine (all kernels silently fell back to torch's, a bf16 job ran 1.8x
    slower) while an AVX2 machine's tests passed. Every branch is checked here, on any
    machine: none (x86-64), AVX2, AVX-512 without and with bf16. The bindings have no
    branches: every build compiles them."""
    from torch.utils.cpp_extension import include_paths

    headers = [f"-I{path}" for path in [*include_paths(), sysconfig.get_paths()["include"]]]
    source = str(Path(cpu_kernels.__file__).with_suffix(".cpp"))
    checks = {
        arch: subprocess.Popen(
            ["c++", "-fsyntax-only", "-std=c++20", "-fopenmp", f"-march={arch}", *headers, source],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for arch in ("x86-64", "haswell", "skylake-avx512", "cooperlake")
    }
    outputs = {arch: check.communicate()[0] for arch, check in checks.items()}
    broken = [arch for arch, check in checks.items() if check.returncode]
    assert not broken, "\n".join(f"-march={arch}:\n{outputs[arch][:1500]}" for arch in broken)

"""--dtype: auto picks bf16 only where the device multiplies it natively."""

from __future__ import annotations

import pytest
import torch

from eagle2_core import precision
from eagle2_core.precision import dtype_name, native_bf16, resolve_dtype


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "native"), [(0, 0, False), (1, 0, True), (0, 1, True)]
)
def test_a_cpu_is_native_with_amx_or_avx512_bf16(
    monkeypatch: pytest.MonkeyPatch, amx: int, avx512_bf16: int, native: bool
) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: bool(amx))
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: bool(avx512_bf16))
    assert native_bf16("cpu") is native
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if native else torch.float32)
    # an explicit choice is taken as it is, native or not
    assert resolve_dtype("bf16", "cpu") == torch.bfloat16
    assert resolve_dtype("fp32", "cpu") == torch.float32


def test_cuda_is_native_and_names_round_trip(monkeypatch: pytest.MonkeyPatch) -> None:
    assert native_bf16("cuda:0")
    monkeypatch.setattr(precision, "native_bf16", lambda device: True)
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    assert [dtype_name(resolve_dtype(n, "cpu")) for n in ("fp32", "bf16")] == ["fp32", "bf16"]
    with pytest.raises(ValueError, match="auto, fp32, bf16"):
        resolve_dtype("fp16", "cpu")

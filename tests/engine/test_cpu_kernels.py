"""cpu_kernels: its choice of instruction-set flags (a CPU newer than its compiler, AMX
on GCC 10, AVX512-BF16 on GCC 9, must not fail the whole kernel build over one flag),
and the pure-torch paths it leaves when the build fails (with a warning) or the kernels
are turned off (without one)."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import pytest

from tandem.engine.model import cpu_kernels
from tandem.engine.model.attention_metadata import AttentionMetadata


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler on this machine")
def test_the_compiler_probe_tells_known_flags_from_unknown_ones(monkeypatch) -> None:
    monkeypatch.delenv("CXX", raising=False)
    assert cpu_kernels.compiler_accepts(("-O2",))
    assert not cpu_kernels.compiler_accepts(("-mno-such-extension-anywhere",))


def test_a_missing_compiler_accepts_nothing(monkeypatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert not cpu_kernels.compiler_accepts.__wrapped__(("-O2",))


def test_flags_the_compiler_refuses_are_left_out(monkeypatch) -> None:
    refused = {cpu_kernels.BF16_FLAG, *cpu_kernels.AMX_FLAGS}
    monkeypatch.setattr(cpu_kernels, "compiler_accepts", lambda flags: not set(flags) & refused)
    flags = cpu_kernels.isa_flags()
    assert not refused & set(flags)
    assert not cpu_kernels.has_bf16_dot()  # the greedy head's screen is left out with it


EVERY_EXTENSION = {
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512vl",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
}


@pytest.mark.parametrize(
    ("cap", "widest"),
    [("avx2", "-mf16c"), ("avx512", cpu_kernels.BF16_FLAG), (None, cpu_kernels.AMX_FLAGS[-1])],
)
def test_tandem_cpu_isa_caps_the_extensions_the_kernels_are_built_with(monkeypatch, cap, widest):
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: set(EVERY_EXTENSION))
    monkeypatch.setattr(cpu_kernels, "compiler_accepts", lambda flags: True)
    if cap is None:
        monkeypatch.delenv(cpu_kernels.ENV_ISA, raising=False)
    else:
        monkeypatch.setenv(cpu_kernels.ENV_ISA, cap)
    flags = cpu_kernels.isa_flags()
    assert flags[-1] == widest  # the widest extension allowed, nothing past it
    assert cpu_kernels.has_bf16_dot() == (cap != "avx2")


def test_an_unknown_isa_cap_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV_ISA, "sse9")
    with pytest.raises(ValueError, match="TANDEM_CPU_ISA='sse9': use one of avx2, avx512, amx"):
        cpu_kernels.isa_flags()


def test_kernels_disabled_by_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_kernels.ENV_DISABLE, "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # disabled on purpose: no warning
        assert cpu_kernels.load() is None
    meta = AttentionMetadata.build([4], [1], [[0]], 16, False, "cpu")
    assert meta.paged is None and meta.decode is not None
    with pytest.raises(ValueError, match=r"cpu_kernels\.load"):
        AttentionMetadata.build([4], [1], [[0]], 16, False, "cpu", kernel=True)


def test_failed_build_warns_and_falls_back(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    broken = tmp_path / "broken.cpp"
    broken.write_text('#error "no kernels today"\n')
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.warns(RuntimeWarning, match="C\\+\\+ CPU kernels are unavailable") as caught:
        assert cpu_kernels.build((broken,)) is None
    assert len(caught) == 1
    assert "no kernels today" in str(caught[0].message)  # the compiler's reason is passed on
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)  # as a failed build leaves it
    meta = AttentionMetadata.build([4], [1], [[0]], 16, False, "cpu")
    assert meta.paged is None and meta.decode is not None

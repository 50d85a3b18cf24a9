"""kernels.cpu_features: bfloat16 detection from the CPU's own flags, and the forcing switch."""
import pytest
import torch

from splitmoe.kernels import cpu_features as cf


def test_bf16_detection_is_the_cpus_flags_not_mkldnn_emulation():
    """True only with AVX512-BF16 / AMX-BF16 (x86) or BF16 (arm) in the CPU's flags."""
    if not cf.cpu_flags():
        pytest.skip("no /proc/cpuinfo flags on this system")
    assert cf.cpu_has_native_bf16() == bool(cf.cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})


@pytest.mark.parametrize("native_bf16", [True, False])
def test_gemm_dtype_follows_the_cpu_unless_forced(native_bf16, monkeypatch):
    monkeypatch.setattr(cf, "cpu_has_native_bf16", lambda: native_bf16)
    monkeypatch.delenv(cf.GEMM_DTYPE_ENV, raising=False)
    assert cf.gemm_dtype() == (torch.bfloat16 if native_bf16 else torch.float32)
    monkeypatch.setenv(cf.GEMM_DTYPE_ENV, "auto")
    assert cf.gemm_dtype() == (torch.bfloat16 if native_bf16 else torch.float32)
    for name, dtype in (("float32", torch.float32), ("BFloat16 ", torch.bfloat16)):
        monkeypatch.setenv(cf.GEMM_DTYPE_ENV, name)
        assert cf.gemm_dtype() == dtype


def test_a_wrong_forced_dtype_is_named(monkeypatch):
    monkeypatch.setenv(cf.GEMM_DTYPE_ENV, "float16")
    with pytest.raises(ValueError, match="SPLITMOE_GEMM_DTYPE='float16'"):
        cf.gemm_dtype()


def test_describe_names_the_cpu_flags_and_paths(monkeypatch):
    monkeypatch.setenv(cf.GEMM_DTYPE_ENV, "float32")
    text = cf.describe()
    assert cf.cpu_model() in text and "avx512_vnni=" in text and "avx512_bf16=" in text
    assert "native kernels isa:" in text and "prefill gemm dtype: float32" in text


def test_the_cpu_is_named_with_its_family_and_model():
    """Zen 4 and Zen 5 virtual machines both call themselves "AMD EPYC"; the kernel choices are
    kept per CPU by this name."""
    block = "processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: {f}\nmodel\t\t: {m}\nmodel name\t: AMD EPYC\n"
    zen4 = block.format(n=0, f=25, m=17) + "\n" + block.format(n=1, f=25, m=17)
    zen5 = block.format(n=0, f=26, m=2)
    assert cf.model_from_cpuinfo(zen4) == "AMD EPYC (family 25, model 17)"
    assert cf.model_from_cpuinfo(zen5) == "AMD EPYC (family 26, model 2)"
    assert cf.model_from_cpuinfo("processor\t: 0\nmodel name\t: Apple M2\n") == "Apple M2"

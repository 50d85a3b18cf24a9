"""kernels.int4pack: Q4_0/Q4_1/Q4_K in torch's int4 layout, against kernels.quants and float64.

The nibbles move losslessly and (q - 8) * scale + zero is the reference's value up to float32
rounding; only the bfloat16 scales/zeros and activations of torch's kernel are lossy (~0.3%).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from splitmoe.kernels import int4pack
from splitmoe.kernels.int4pack import can_pack_all, can_repack, pack, repack_expert, unpack
from splitmoe.kernels.moe import ExpertFFN
from splitmoe.kernels.quants import QuantTensor, dequantize
from tests.kernels.test_expert_kernels import realistic_blocks

Q4 = [T.Q4_0, T.Q4_1, T.Q4_K]
pytestmark = pytest.mark.skipif(not int4pack.available(), reason="this torch has no CPU int4 kernels")


def qt(qtype: T, shape: tuple[int, int], seed: int) -> QuantTensor:
    return QuantTensor(f"w{seed}", int(qtype), shape, realistic_blocks(qtype, shape, np.random.default_rng(seed)))


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("qtype", Q4, ids=lambda t: t.name)
def test_unpack_is_the_reference_dequantization(qtype):
    w = qt(qtype, (48, 512), 1)
    q, scale, zero = unpack(w)
    assert q.dtype == torch.uint8 and int(q.max()) <= 15
    got = (q.float() - 8) * scale.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
    want = dequantize(w)
    assert (got - want).abs().max().item() <= 1e-6 * want.abs().max().item()


@pytest.mark.parametrize("rows", [(64, 64), (48, 80), (16,)], ids=["blocks-of-64", "odd-rows", "16-rows"])
@pytest.mark.parametrize("qtype", Q4, ids=lambda t: t.name)
def test_pack_matches_torch_packer_and_float64(qtype, rows):
    """Row-concatenated matrices (gate then up), through the direct packer (rows % 64 == 0) or
    torch's own (other row counts): the packed bytes equal torch's, the product float64's."""
    ws = [qt(qtype, (n, 256), 10 + i) for i, n in enumerate(rows)]
    packed = pack(ws)
    q = torch.cat([unpack(w)[0] for w in ws]).to(torch.int32)
    assert torch.equal(packed.packed, torch._convert_weight_to_int4pack_for_cpu(q, 1))
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0)).bfloat16()
    want = x.double() @ torch.cat([dequantize(w) for w in ws]).double().T
    got = packed.matmul(x)
    assert got.dtype == torch.bfloat16 and got.shape == (5, sum(rows))
    assert rel_l2(got, want) <= 1e-2


def test_one_token_and_many():
    w = pack([qt(T.Q4_K, (128, 512), 3)])
    ref = dequantize(qt(T.Q4_K, (128, 512), 3)).double()
    for m in (1, 300):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).bfloat16()
        assert rel_l2(w.matmul(x), x.double() @ ref.T) <= 1e-2


def test_to_dense_round_trip():
    w = qt(T.Q4_1, (64, 256), 4)
    assert rel_l2(int4pack.to_dense(pack([w])), dequantize(w).double()) <= 1e-2


def test_what_cannot_be_packed():
    assert not can_pack_all([qt(T.Q8_0, (64, 256), 5)])
    assert not can_pack_all([qt(T.Q4_0, (8, 256), 6)])  # torch wants rows % 16 == 0
    assert not can_pack_all([qt(T.Q4_0, (64, 256), 7), qt(T.Q4_0, (64, 512), 8)])  # row lengths differ
    assert not can_pack_all([])
    with pytest.raises(ValueError, match="int4 pack"):
        pack([qt(T.Q6_K, (64, 256), 9)])


def test_repack_expert_fuses_gate_and_up_and_keeps_other_downs_out():
    """Q4_K_M's experts: gate/up Q4_K (fused: [2*ffn, D]), down Q6_K (not repacked)."""
    gate, up = qt(T.Q4_K, (256, 256), 11), qt(T.Q4_K, (256, 256), 12)
    mixed = ExpertFFN(gate, up, qt(T.Q6_K, (256, 256), 13))
    assert can_repack(mixed)
    p = repack_expert(mixed)
    assert p.down is None and (p.gate_up.n, p.gate_up.k) == (512, 256)
    all4 = repack_expert(ExpertFFN(gate, up, qt(T.Q4_0, (256, 256), 14)))
    assert all4.down is not None and (all4.down.n, all4.down.k) == (256, 256)
    assert not can_repack(ExpertFFN(qt(T.Q8_0, (256, 256), 15), up, qt(T.Q4_0, (256, 256), 14)))

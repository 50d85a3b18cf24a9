"""device_attention against the repository's float32 references (`grouped_attention` per sequence,
`latent_attention`) and a float64 computation whose masks come from attention.py `visible_from`.

Decode batches mix sequences of 1 to 64 tokens in one padded slot table whose slots are a random
permutation of the pool, so only a correct gather and mask can match. Tracing with fake tensors
proves the decode functions have no data-dependent shapes or values; the CUDA tests compare the
GPU with these CPU results and replay a captured CUDA graph on new inputs.
"""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from splitmoe.attention_service.model import device_attention
from splitmoe.attention_service.model.attention import grouped_attention, visible_from
from splitmoe.attention_service.model.device_attention import (
    paged_decode_attention,
    paged_latent_decode_attention,
    prompt_attention_sdpa,
)
from splitmoe.attention_service.model.mla import latent_attention
from tests.support.cuda_graphs import captured as cuda_graph

NUM_SLOTS = 256
LENGTHS = [1, 7, 30, 64, 45]  # context tokens of each row's sequence
TABLE_POSITIONS = 72  # the padded context bucket: every table row has padding


def assert_close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rel * want.abs().max().item() + 1e-6, f"max error {err:.3g}"


def visible_by_rule(context: list[int], q_positions: list[int], context_lens: list[int], window_tokens: int = 0,
                    chunk_tokens: int = 0) -> torch.Tensor:
    """bool [N, C], position by position from attention.py's rule."""
    return torch.tensor([[c < n and visible_from(p, window_tokens, chunk_tokens) <= c <= p for c in context]
                         for p, n in zip(q_positions, context_lens)])


def dense_f64(q, keys, values, visible, scale, sinks=None) -> torch.Tensor:
    """float64 [N, H, Dv]: q [N, H, D] over per-row keys [N, G, C, D] / values [N, G, C, Dv]."""
    R = q.shape[1] // keys.shape[1]
    keys, values = keys.double().repeat_interleave(R, 1), values.double().repeat_interleave(R, 1)
    scores = torch.einsum("nhd,nhcd->nhc", q.double(), keys) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks.double()[None, :, None].expand(q.shape[0], -1, 1)), -1)
    probs = torch.softmax(scores, -1)[..., : keys.shape[2]]
    return torch.einsum("nhc,nhcd->nhd", probs, values)


@dataclasses.dataclass
class DecodeCase:
    q: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    slot_table: torch.Tensor
    context_lens: torch.Tensor
    q_positions: torch.Tensor
    sinks: torch.Tensor | None
    scale: float

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k_pool, self.v_pool, self.slot_table, self.context_lens, self.q_positions

    def to(self, device: str) -> "DecodeCase":
        moved = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return DecodeCase(**{n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in moved.items()})


def make_decode_case(seed: int, G: int, R: int, D: int = 16, Dv: int = 16, lengths=LENGTHS,
                     pool_dtype=torch.float32, sinks: bool = False, same_sequence: bool = False,
                     pad_slot: int | None = 0) -> DecodeCase:
    """One row per length, each at its sequence's last position, slots scattered over the pool;
    `same_sequence`: the first two rows are one sequence's last two tokens (multi-token decode).
    pad_slot None pads the tables with random slots."""
    gen = torch.Generator().manual_seed(seed)
    H, B = G * R, len(lengths)
    slots = torch.randperm(NUM_SLOTS, generator=gen)
    table = torch.randint(NUM_SLOTS, (B, TABLE_POSITIONS), generator=gen)  # drawn always: the same case either way
    if pad_slot is not None:
        table.fill_(pad_slot)
    offset = 0
    for b, n in enumerate(lengths):
        table[b, :n] = slots[offset : offset + n]
        offset += n
    context_lens = torch.tensor(lengths)
    q_positions = context_lens - 1
    if same_sequence:
        table[0], context_lens[0], q_positions[0] = table[1], context_lens[1], q_positions[1] - 1
    return DecodeCase(
        q=torch.randn(B, H, D, generator=gen), k_pool=torch.randn(G, NUM_SLOTS, D, generator=gen).to(pool_dtype),
        v_pool=torch.randn(G, NUM_SLOTS, Dv, generator=gen).to(pool_dtype), slot_table=table,
        context_lens=context_lens, q_positions=q_positions,
        sinks=torch.randn(H, generator=gen) if sinks else None, scale=D**-0.5)


def decode(case: DecodeCase, **kw) -> torch.Tensor:
    return paged_decode_attention(*case.tensors(), case.scale, sinks=case.sinks, **kw)


def grouped_reference(case: DecodeCase, window_tokens: int = 0, chunk_tokens: int = 0) -> torch.Tensor:
    """grouped_attention row by row over the context up to the row's own token."""
    rows = []
    for b, (n, p) in enumerate(zip(case.context_lens.tolist(), case.q_positions.tolist())):
        slots = case.slot_table[b, : min(n, p + 1)]
        rows.append(grouped_attention(case.q[b : b + 1], case.k_pool[:, slots], case.v_pool[:, slots],
                                      case.q_positions[b : b + 1], case.scale, window_tokens=window_tokens,
                                      sinks=case.sinks, chunk_tokens=chunk_tokens))
    return torch.cat(rows)


def f64_reference(case: DecodeCase, window_tokens: int = 0, chunk_tokens: int = 0) -> torch.Tensor:
    visible = visible_by_rule(list(range(TABLE_POSITIONS)), case.q_positions.tolist(), case.context_lens.tolist(),
                              window_tokens, chunk_tokens)
    keys, values = case.k_pool[:, case.slot_table], case.v_pool[:, case.slot_table]  # [G, B, C, *]
    return dense_f64(case.q, keys.transpose(0, 1), values.transpose(0, 1), visible, case.scale, case.sinks)


DECODE_CASES = {
    "mha": dict(G=4, R=1),
    "gqa4": dict(G=2, R=4),
    "gqa8": dict(G=1, R=8),
    "odd-head-dims": dict(G=2, R=4, D=40, Dv=24),
    "bf16-pools": dict(G=2, R=4, pool_dtype=torch.bfloat16),
    "window-inside-context": dict(G=2, R=4, window_tokens=5),
    "window-past-context": dict(G=2, R=4, window_tokens=100),
    "chunked": dict(G=2, R=4, chunk_tokens=8),
    "sinks": dict(G=2, R=4, sinks=True),
    "sinks-window-bf16": dict(G=1, R=8, sinks=True, window_tokens=6, pool_dtype=torch.bfloat16),
    "multi-token": dict(G=2, R=4, same_sequence=True),
    "multi-token-chunked-sinks": dict(G=2, R=4, same_sequence=True, chunk_tokens=4, sinks=True),
    "random-padding": dict(G=2, R=4, pad_slot=None),
}


@pytest.mark.parametrize("name", DECODE_CASES)
def test_paged_decode_matches_references(name):
    kw = dict(DECODE_CASES[name])
    mask = {k: kw.pop(k) for k in ("window_tokens", "chunk_tokens") if k in kw}
    case = make_decode_case(len(name), **kw)
    got = decode(case, **mask)
    assert got.shape == case.q.shape[:2] + case.v_pool.shape[-1:] and got.dtype == case.q.dtype
    assert_close(got, grouped_reference(case, **mask))
    assert_close(got, f64_reference(case, **mask))


@pytest.mark.parametrize("name", DECODE_CASES)
def test_paged_decode_in_context_chunks_matches_references(name, monkeypatch):
    """Contexts wider than a chunk go in chunks with an online softmax: chunks of 8 positions here
    (the table is 72 wide), a row's context often starting or ending inside one, or seeing none
    of it (windows, padding)."""
    monkeypatch.setattr(device_attention, "CONTEXT_CHUNK_TOKENS", 8)
    kw = dict(DECODE_CASES[name])
    mask = {k: kw.pop(k) for k in ("window_tokens", "chunk_tokens") if k in kw}
    case = make_decode_case(len(name) + 100, **kw)
    got = decode(case, **mask)
    assert_close(got, f64_reference(case, **mask))


def test_chunks_of_the_latent_context_match_one_pass(monkeypatch):
    q, pool, table, lens, positions, scale, L = make_latent_case(6, same_sequence=True)
    whole = paged_latent_decode_attention(q, pool, table, lens, positions, scale, L)
    monkeypatch.setattr(device_attention, "CONTEXT_CHUNK_TOKENS", 16)
    assert_close(paged_latent_decode_attention(q, pool, table, lens, positions, scale, L), whole)


def test_padding_never_reaches_the_result():
    """The same rows padded with slot 0 or with random slots give the same bits."""
    padded_zero = make_decode_case(3, G=2, R=4, sinks=True, pad_slot=0)
    padded_random = make_decode_case(3, G=2, R=4, sinks=True, pad_slot=None)
    assert not torch.equal(padded_zero.slot_table, padded_random.slot_table)
    assert torch.equal(decode(padded_zero, window_tokens=9), decode(padded_random, window_tokens=9))


def test_rows_that_see_nothing_give_zeros():
    """A padding row of a captured batch (context_len 0) gives zeros; the other rows are unchanged."""
    case = make_decode_case(4, G=2, R=4)
    full = decode(case)
    case.context_lens[2] = 0
    got = decode(case)
    assert torch.equal(got[2], torch.zeros_like(got[2]))
    assert torch.equal(got[[0, 1, 3, 4]], full[[0, 1, 3, 4]])


def make_latent_case(seed: int, H: int = 4, L: int = 32, R: int = 8, same_sequence: bool = False):
    gen = torch.Generator().manual_seed(seed)
    base = make_decode_case(seed, G=1, R=1, same_sequence=same_sequence)
    latent_pool = torch.randn(NUM_SLOTS, L + R, generator=gen)
    q = torch.randn(len(LENGTHS), H, L + R, generator=gen)
    return q, latent_pool, base.slot_table, base.context_lens, base.q_positions, (L + R) ** -0.5, L


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("same_sequence", [False, True])
def test_paged_latent_decode_matches_references(pool_dtype, same_sequence):
    q, pool, table, lens, positions, scale, L = make_latent_case(5, same_sequence=same_sequence)
    pool = pool.to(pool_dtype)
    got = paged_latent_decode_attention(q, pool, table, lens, positions, scale, L)
    assert got.shape == (*q.shape[:2], L)
    want = torch.cat([latent_attention(q[b : b + 1], pool[table[b, :n]], positions[b : b + 1], scale, L)
                      for b, n in enumerate(lens.tolist())])
    assert_close(got, want)
    visible = visible_by_rule(list(range(TABLE_POSITIONS)), positions.tolist(), lens.tolist())
    latents = pool[table][:, None]  # [B, 1, C, L+R]: one head
    assert_close(got, dense_f64(q, latents, latents[..., :L], visible, scale))


def _fake_traced(fn, *args) -> torch.fx.GraphModule:
    """fn traced with fake tensors: a read of a value (item, int, bool) raises, and a shape that
    follows the data gets a symbol instead of a number; the graph is what a CUDA graph captures."""
    return make_fx(fn, tracing_mode="fake")(*args)


def _has_static_shapes(graph: torch.fx.GraphModule) -> bool:
    values = [node.meta.get("val") for node in graph.graph.nodes]
    return all(isinstance(size, int) for v in values if isinstance(v, torch.Tensor) for size in v.shape)


def test_fake_tracing_catches_data_dependent_code():
    """The checks below can fail: a sync does not trace, a data-dependent shape shows."""
    lens = torch.tensor([3, 5])
    with pytest.raises(Exception, match="data-dependent"):
        _fake_traced(lambda x: torch.arange(int(x.max())), lens)
    assert not _has_static_shapes(_fake_traced(lambda x: x[x > 3], lens))
    assert _has_static_shapes(_fake_traced(lambda x: x.masked_fill(x > 3, 0), lens))


@pytest.mark.parametrize("latent", [False, True])
def test_decode_traces_without_data_and_replays_new_inputs(latent):
    """Traced once on one batch, the graph gives eager's result on another batch of the same
    shapes (other lengths, slots, positions, queries): nothing was read from the data."""
    if latent:
        *first, scale, L = make_latent_case(6)
        *second, _, _ = make_latent_case(7, same_sequence=True)
        fn = functools.partial(paged_latent_decode_attention, scale=scale, latent_dims=L)
    else:
        first_case = make_decode_case(6, G=2, R=4, sinks=True)
        second_case = make_decode_case(7, G=2, R=4, sinks=True, lengths=[3, 64, 12, 1, 40])
        first, second = [*first_case.tensors(), first_case.sinks], [*second_case.tensors(), second_case.sinks]

        def fn(q, k, v, table, lens, positions, sinks):
            return paged_decode_attention(q, k, v, table, lens, positions, 0.25, window_tokens=20, sinks=sinks)
    graph = _fake_traced(fn, *first)
    assert _has_static_shapes(graph)
    assert torch.equal(graph(*second), fn(*second))
    assert not torch.equal(graph(*second), fn(*first))


def make_prompt(seed: int, G: int, R: int, T: int, C: int, D: int = 16, Dv: int = 16, first_position: int = 0,
                sinks: bool = False, kv_dtype=torch.float32):
    """q [T, H, D] of the context's last T positions, k [G, C, D], v [G, C, Dv] from first_position."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, G * R, D, generator=gen)
    k = torch.randn(G, C, D, generator=gen).to(kv_dtype)
    v = torch.randn(G, C, Dv, generator=gen).to(kv_dtype)
    positions = torch.arange(first_position + C - T, first_position + C)
    return q, k, v, positions, D**-0.5, dict(first_position=first_position,
                                             sinks=torch.randn(G * R, generator=gen) if sinks else None)


PROMPT_CASES = {
    "mha-whole-prompt": dict(G=4, R=1, T=20, C=20),
    "gqa-whole-prompt": dict(G=2, R=4, T=33, C=33),
    "chunk-after-cached-context": dict(G=2, R=4, T=12, C=40),
    "chunk-after-skipped-positions-window": dict(G=2, R=4, T=12, C=30, first_position=10, window_tokens=16),
    "window-across-prompt": dict(G=1, R=8, T=30, C=30, window_tokens=8),
    "sinks": dict(G=2, R=4, T=25, C=25, sinks=True),
    "sinks-window-after-context": dict(G=2, R=4, T=9, C=41, sinks=True, window_tokens=12),
    "chunked": dict(G=2, R=4, T=40, C=40, chunk_tokens=16),
    "chunked-after-context": dict(G=2, R=4, T=10, C=40, first_position=16, chunk_tokens=16),
    "value-dims-differ-sinks": dict(G=2, R=4, T=17, C=29, D=40, Dv=24, sinks=True),
    "bf16-kv": dict(G=2, R=4, T=12, C=40, kv_dtype=torch.bfloat16, sinks=True),
}


@pytest.mark.parametrize("name", PROMPT_CASES)
def test_prompt_sdpa_matches_grouped_attention(name):
    kw = dict(PROMPT_CASES[name])
    mask = {k: kw.pop(k) for k in ("window_tokens", "chunk_tokens") if k in kw}
    q, k, v, positions, scale, extra = make_prompt(len(name) + 100, **kw)
    got = prompt_attention_sdpa(q, k, v, positions, scale, **mask, **extra)
    assert got.shape == (*q.shape[:2], v.shape[-1]) and got.dtype == q.dtype
    assert_close(got, grouped_attention(q, k, v, positions, scale, **mask, **extra))
    first, C = extra["first_position"], k.shape[1]
    visible = visible_by_rule(list(range(first, first + C)), positions.tolist(), [first + C] * len(positions),
                              mask.get("window_tokens", 0), mask.get("chunk_tokens", 0))
    rows = q.shape[0]
    want = dense_f64(q, k[None].expand(rows, -1, -1, -1), v[None].expand(rows, -1, -1, -1), visible, scale,
                     extra["sinks"])
    assert_close(got, want)


# ---- CUDA: the same functions on the GPU, and a captured decode replayed on new inputs ----


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["gqa8", "sinks-window-bf16", "multi-token-chunked-sinks", "bf16-pools"])
def test_cuda_paged_decode_matches_cpu(name):
    kw = dict(DECODE_CASES[name], pool_dtype=torch.bfloat16, D=64, Dv=64)
    mask = {k: kw.pop(k) for k in ("window_tokens", "chunk_tokens") if k in kw}
    case = make_decode_case(11, **kw)
    got = decode(case.to("cuda"), **mask)
    assert got.is_cuda
    assert_close(got.cpu(), decode(case, **mask))


@pytest.mark.cuda
def test_cuda_latent_decode_matches_cpu():
    q, pool, table, lens, positions, scale, L = make_latent_case(12, H=16, L=64, R=16)
    pool = pool.to(torch.bfloat16)
    want = paged_latent_decode_attention(q, pool, table, lens, positions, scale, L)
    args = (t.cuda() for t in (q, pool, table, lens, positions))
    assert_close(paged_latent_decode_attention(*args, scale, L).cpu(), want)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["gqa-whole-prompt", "sinks-window-after-context", "chunked-after-context",
                                  "bf16-kv"])
def test_cuda_prompt_sdpa_runs_the_efficient_kernel_and_matches_cpu(name):
    """Only the memory-efficient kernel is allowed: were the inputs unfit for it (a GQA layout, a
    head dim, the sink key), SDPA would raise instead of falling back to the math kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kw = dict(PROMPT_CASES[name], D=64, Dv=64)
    mask = {k: kw.pop(k) for k in ("window_tokens", "chunk_tokens") if k in kw}
    q, k, v, positions, scale, extra = make_prompt(13, **kw)
    want = prompt_attention_sdpa(q, k, v, positions, scale, **mask, **extra)
    extra["sinks"] = None if extra["sinks"] is None else extra["sinks"].cuda()
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        got = prompt_attention_sdpa(q.cuda(), k.cuda(), v.cuda(), positions.cuda(), scale, **mask, **extra)
    assert_close(got.cpu(), want, rel=1e-4)  # the kernel's float32 products (3xTF32) round differently


@pytest.mark.cuda
def test_cuda_graph_replays_decode_on_new_inputs():
    """Captured once, replayed after new queries, slots, lengths and positions are copied into the
    captured tensors: the eager result on those inputs."""
    first = make_decode_case(14, G=2, R=4, D=64, Dv=64, pool_dtype=torch.bfloat16, sinks=True).to("cuda")
    second = make_decode_case(15, G=2, R=4, D=64, Dv=64, pool_dtype=torch.bfloat16, sinks=True,
                              same_sequence=True, lengths=[9, 9, 64, 2, 50]).to("cuda")

    def step():
        return decode(first, window_tokens=33)

    graph, captured = cuda_graph(step, warmups=3)
    before = decode(first, window_tokens=33)
    for static, new in zip((*first.tensors(), first.sinks), (*second.tensors(), second.sinks)):
        static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    want = decode(second, window_tokens=33)
    assert_close(captured, want, rel=1e-6)
    assert not torch.allclose(captured, before)

"""Zero-split taps (kernels/gdn_taps.py) against SGLang's own GDN chunk kernel.

Without a GPU everything runs under the Triton interpreter on small shapes; on a GPU the same
tests run compiled on Qwen3.5-27B's GDN head shape. Bitwise comparisons hold within one process
(both kernels run the same launch configuration).
"""
import pytest
import torch

from tests.kernels import fla_interpreter

CUDA = torch.cuda.is_available()
if not CUDA:
    fla_interpreter.patch()

from sglang.kernels.ops.attention.fla.chunk import chunk_gated_delta_rule  # noqa: E402
from sglang.kernels.ops.attention.fla.chunk_delta_h import chunk_gated_delta_rule_fwd_h  # noqa: E402

from hpc_radix.kernels.gdn_taps import (  # noqa: E402
    CHUNK,
    build_tap_tables,
    capture_conv_taps,
    capture_conv_taps_reference,
    chunk_gated_delta_rule_with_taps,
    copy_end_taps,
    fwd_h_with_taps,
)

DEV = "cuda" if CUDA else "cpu"
# (key heads, value heads, head dim, a long extend); the GPU runs Qwen3.5-27B's GDN shape
HK, HV, D, LONG = (16, 48, 128, 512) if CUDA else (1, 2, 64, 200)
OFF_GRID = [1, 3, 63, 65, 127, LONG - 1]
ON_GRID = [64, 128]
SLOTS = 48


def inputs(T, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, T, HK, D, generator=g).to(torch.bfloat16)
    k = torch.randn(1, T, HK, D, generator=g).to(torch.bfloat16)
    v = torch.randn(1, T, HV, D, generator=g).to(torch.bfloat16)
    gate = -torch.rand(1, T, HV, generator=g) * 0.5
    beta = torch.rand(1, T, HV, generator=g)
    return [t.to(DEV) for t in (q, k, v, gate, beta)]


def state_pool(dtype=torch.float32, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(SLOTS, HV, D, D, generator=g) * 0.1).to(dtype).to(DEV)


def cu(lens):
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device=DEV)


def idx(slots):
    return torch.tensor(slots, dtype=torch.int32, device=DEV)


def stock(x, pool, segments, slots):
    """SGLang's kernel over the [lo, hi) segments of x, one sequence each, state in place."""
    parts = [[t[:, lo:hi] for t in x] for lo, hi in segments]
    cat = [torch.cat([p[i] for p in parts], dim=1) for i in range(5)]
    o, _, h = chunk_gated_delta_rule(*cat, initial_state=pool, initial_state_indices=idx(slots),
                                     cu_seqlens=cu([hi - lo for lo, hi in segments]),
                                     head_first=False, use_qk_l2norm_in_kernel=True)
    return o, h


def ours(x, pool, lens, work, taps):
    """One pass with taps = [(row, position in the row's extend, slot)]."""
    starts = cu(lens).tolist()[:-1]
    tables = build_tap_tables(starts, lens, taps, idx(work), conv_width=3, device=DEV)
    o, _, h = chunk_gated_delta_rule_with_taps(*x, initial_state=pool, initial_state_indices=idx(work),
                                               cu_seqlens=cu(lens), tables=tables)
    conv = torch.zeros(SLOTS, 1, 3, device=DEV)
    copy_end_taps(tables, [conv[None], pool[None]])        # the pool's [layers, slots, ...] form
    return o, h


def test_fwd_h_without_taps_is_the_stock_kernel():
    x = inputs(LONG + 70, seed=3)
    lens = [LONG, 70]
    q, k, v, gate, beta = x
    from sglang.kernels.ops.attention.fla.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from sglang.kernels.ops.attention.fla.cumsum import chunk_local_cumsum
    from sglang.kernels.ops.attention.fla.l2norm import l2norm_fwd
    k = l2norm_fwd(k)
    g_cum = chunk_local_cumsum(gate, chunk_size=CHUNK, cu_seqlens=cu(lens))
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g_cum, beta=beta, cu_seqlens=cu(lens))
    a, b = state_pool(), state_pool()
    h1, v1 = chunk_gated_delta_rule_fwd_h(k, w, u, g_cum, initial_state=a, initial_state_indices=idx([2, 5]),
                                          cu_seqlens=cu(lens))
    h2, v2 = fwd_h_with_taps(k, w, u, g_cum, b, idx([2, 5]), cu(lens))
    assert torch.equal(h1, h2) and torch.equal(v1, v2) and torch.equal(a, b)


def test_pass_with_taps_leaves_output_and_final_state_as_stock():
    x = inputs(LONG + 70, seed=4)
    a, b = state_pool(), state_pool()
    o1, h1 = stock(x, a, [(0, LONG), (LONG, LONG + 70)], [2, 5])
    o2, h2 = ours(x, b, [LONG, 70], [2, 5], [(0, 3, 10), (0, 64, 11), (0, LONG - 1, 12), (1, 65, 13)])
    assert torch.equal(o1, o2) and torch.equal(h1, h2)
    assert torch.equal(a[2], b[2]) and torch.equal(a[5], b[5])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_tap_is_the_state_of_a_separate_call(dtype):
    """A tap at p (p - s in {1, 3, 63, 64, 65, 127, 128, n-1, n}) against stock calls: one call
    on [s, p) for an fp32 pool; with a bf16 pool, calls on [s, b) then [b, p) (b the grid point
    below p), which round the state at b as the pool does (the end of the extend is the pass's
    own final state: one call)."""
    x = inputs(LONG, seed=5)
    positions = sorted(OFF_GRID + ON_GRID + [LONG])
    pool = state_pool(dtype)
    taps = [(0, p, 10 + i) for i, p in enumerate(positions)]
    ours(x, pool, [LONG], [2], taps)
    for _, p, slot in taps:
        ref = state_pool(dtype)
        b = p - p % CHUNK if dtype is torch.bfloat16 and p < LONG else 0
        if b:
            stock(x, ref, [(0, b)], [2])
        if p > b:
            stock(x, ref, [(b, p)], [2])
        assert torch.equal(pool[slot], ref[2]), f"tap at {p}"


def test_varlen_batch_taps_per_sequence():
    """Three sequences resumed from different states, taps in each, two in one chunk."""
    lens = [LONG, 97, 130]
    x = inputs(sum(lens), seed=6)
    starts = cu(lens).tolist()
    taps = [(0, 3, 10), (0, 40, 11), (0, 64, 12), (1, 1, 13), (1, 96, 14), (2, 65, 15), (2, 130, 16)]
    pool = state_pool()
    ours(x, pool, lens, [2, 5, 7], taps)
    for row, p, slot in taps:
        ref = state_pool()
        lo = starts[row]
        stock(x, ref, [(lo, lo + p)], [(2, 5, 7)[row]])
        assert torch.equal(pool[slot], ref[(2, 5, 7)[row]]), f"row {row} tap at {p}"


def naive_states(x, s0, positions):
    """float64 reference recurrence: S <- S*exp(g); S += beta (v - S k) k^T, k and q L2-normed."""
    q, k, v, gate, beta = (t[0].double().cpu() for t in x)
    k = torch.nn.functional.normalize(k, dim=-1)
    rep = HV // HK
    S = s0.double().cpu().clone()
    out = {}
    for t in range(max(positions)):
        kt = k[t].repeat_interleave(rep, 0)                       # [HV, D]
        S = S * torch.exp(gate[t])[:, None, None]
        err = v[t] - torch.einsum("hvk,hk->hv", S, kt)
        S = S + beta[t][:, None, None] * torch.einsum("hv,hk->hvk", err, kt)
        if t + 1 in positions:
            out[t + 1] = S.clone()
    return out


def test_taps_follow_the_float64_recurrence():
    x = inputs(LONG, seed=7)
    pool = state_pool()
    s0 = pool[2].clone()
    positions = [3, 64, 65, LONG - 1]
    ours(x, pool, [LONG], [2], [(0, p, 10 + i) for i, p in enumerate(positions)])
    ref = naive_states(x, s0, positions)
    for i, p in enumerate(positions):
        err = (pool[10 + i].double().cpu() - ref[p]).abs().max().item()
        assert err < 0.05 * ref[p].abs().max().item(), f"tap at {p}: error {err}"


def test_conv_taps_take_the_inputs_before_the_position():
    """The conv state before p is the W = 3 pre-conv inputs p-3..p-1; inside the first 3 tokens
    of the extend those before it come from the working slot's previous conv state."""
    conv_dim, W = 6, 3
    lens = [10, 5]
    mixed = torch.arange(sum(lens) * conv_dim, dtype=torch.float32, device=DEV).view(-1, conv_dim)
    conv = -torch.arange(SLOTS * conv_dim * W, dtype=torch.float32, device=DEV).view(SLOTS, conv_dim, W)
    before = conv.clone()
    taps = [(0, 1, 20), (0, 2, 21), (0, 7, 22), (1, 3, 23), (1, 5, 24)]
    tables = build_tap_tables([0, 10], lens, taps, idx([2, 5]), conv_width=W, device=DEV)
    capture_conv_taps(tables, mixed, conv)
    for row, p, slot in taps[:-1]:
        start, work = (0, 2) if row == 0 else (10, 5)
        want = torch.stack([mixed[start + j] if j >= 0 else before[work][:, W + j]
                            for j in range(p - W, p)], dim=1)
        assert torch.equal(conv[slot], want), f"row {row} tap at {p}"
    assert torch.equal(conv[24], before[24])          # at the end: copied after the layer
    copy_end_taps(tables, [conv[None], torch.zeros(1, SLOTS, 1, device=DEV)])
    assert torch.equal(conv[24], conv[5])


def test_the_conv_tap_kernel_writes_what_the_torch_ops_do_bitwise():
    """One launch against the six torch ops it replaced: bf16, a conv state stored with the
    window dimension outside the channels (strides as SGLang's pool may lay it out), a
    non-contiguous projection, taps in the first W tokens and further in, several rows."""
    conv_dim, W = 300, 3                          # channels over more than one block of 256
    lens = [70, 2, 40]
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(sum(lens), 2 * conv_dim, generator=g).to(torch.bfloat16).to(DEV)
    mixed = wide[:, conv_dim:]                     # a view, as a split projection is
    store = torch.randn(SLOTS, W, conv_dim, generator=g).to(torch.bfloat16).to(DEV)
    conv = store.transpose(1, 2)                   # [slots, conv_dim, W], W-major in memory
    taps = [(0, 1, 20), (0, 2, 21), (0, 33, 22), (1, 1, 23), (2, 3, 24), (2, 17, 25)]
    tables = build_tap_tables([0, 70, 72], lens, taps, idx([2, 5, 7]), conv_width=W, device=DEV)
    before, want = conv.clone(), conv.clone()
    capture_conv_taps_reference(tables, mixed, want)
    capture_conv_taps(tables, mixed, conv)
    assert torch.equal(conv, want)
    assert all(not torch.equal(conv[slot], before[slot]) for _, _, slot in taps)   # written


def test_tables_carry_flas_chunk_tables_of_the_pass_and_the_off_grid_rows():
    """Built on the host, so the pass never waits for the GPU to learn them."""
    import triton
    from sglang.kernels.ops.attention.fla.index import prepare_chunk_indices, prepare_chunk_offsets

    tables = build_tap_tables([0, 200], [200, 97], [(0, 3, 10), (0, 40, 11), (0, 64, 12), (1, 96, 14)],
                              idx([2, 5]), conv_width=3, device=DEV)
    assert tables.part_cu.tolist() == [0, 3, 43, 75]
    assert torch.equal(tables.part_chunks, prepare_chunk_indices(tables.part_cu, CHUNK))
    for lens in ([200, 97], [1, 64, 65, 1], [3], [0, 20, 9], [16], [17, 40]):
        pass_cu = cu(lens)
        built = build_tap_tables(pass_cu.tolist()[:-1], lens, [], idx(range(len(lens))), conv_width=3, device=DEV)
        assert torch.equal(built.chunk_indices, prepare_chunk_indices(pass_cu, CHUNK)), lens
        assert torch.equal(built.chunk_offsets, prepare_chunk_offsets(pass_cu, CHUNK)), lens
        tokens = sum(lens)
        block = min(CHUNK, max(16, triton.next_power_of_2(tokens)))    # FLA's chunk_fwd_o
        got_block, table = built.output_chunks(tokens)
        assert got_block == block and torch.equal(table, prepare_chunk_indices(pass_cu, block)), lens


def test_a_pass_without_taps_is_stock_and_never_computes_a_chunk_table(monkeypatch):
    """The pass reads no length back (FLA's table would: a wait for the GPU on every prefill)."""
    import sglang.kernels.ops.attention.fla.chunk_o as fla_o
    import sglang.kernels.ops.attention.fla.cumsum as fla_cumsum

    from hpc_radix.kernels import gdn_taps

    x = inputs(200, seed=5)
    small = [t[:, :40] for t in inputs(40, seed=6)]            # under 64 tokens: FLA's smaller block
    pool = state_pool()
    want_pool = pool.clone()
    want_o, _ = stock(x, want_pool, [(0, 130), (130, 200)], [2, 5])
    want_small, _ = stock(small, want_pool, [(0, 25), (25, 40)], [1, 3])
    tables = {name: getattr(gdn_taps, name) for name in ("prepare_chunk_indices", "prepare_chunk_offsets")}
    for module in (gdn_taps, fla_o, fla_cumsum):
        for name in tables:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, lambda *a: pytest.fail("a chunk table"))
    o, _ = ours(x, pool, [130, 70], [2, 5], [])
    o_small, _ = ours(small, pool, [25, 15], [1, 3], [(0, 10, 7)])   # an off-grid tap's own pass
    for name, fn in tables.items():
        monkeypatch.setattr(gdn_taps, name, fn)
    assert torch.equal(o, want_o) and torch.equal(o_small, want_small)
    assert torch.equal(pool[[1, 2, 3, 5]], want_pool[[1, 2, 3, 5]])


def test_tables_refuse_a_tap_outside_its_extend():
    with pytest.raises(ValueError, match="outside the extend"):
        build_tap_tables([0], [10], [(0, 11, 3)], idx([2]), conv_width=3, device=DEV)
    with pytest.raises(ValueError, match="outside the extend"):
        build_tap_tables([0], [10], [(0, 0, 3)], idx([2]), conv_width=3, device=DEV)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="SGLang's conv kernel needs CUDA")
def test_conv_taps_equal_the_conv_kernels_state():
    """Against SGLang's causal_conv1d_fn called as its GDN backend calls it (a transposed view
    and the CPU lengths, which pick its Triton kernel): the conv state it leaves after a call on
    [s, p) from the working slot's state is the tap's, also for p - s < 3."""
    from sglang.srt.layers.attention.mamba.causal_conv1d import causal_conv1d_fn

    dim, W, n = 256, 3, 100
    x = torch.randn(n, dim, device=DEV).to(torch.bfloat16)
    weight = torch.randn(dim, W + 1, device=DEV).to(torch.bfloat16)
    conv = torch.randn(SLOTS, dim, W, device=DEV).to(torch.bfloat16)
    positions = [1, 2, 3, 64, 99]
    taps = [(0, p, 20 + i) for i, p in enumerate(positions)]
    tables = build_tap_tables([0], [n], taps, idx([2]), conv_width=W, device=DEV)
    capture_conv_taps(tables, x, conv)
    for _, p, slot in taps:
        ref = conv.clone()
        ref[3] = conv[2]
        causal_conv1d_fn(x[:p].transpose(0, 1), weight, None, query_start_loc=cu([p]),
                         cache_indices=idx([3]), has_initial_state=torch.tensor([True], device=DEV),
                         conv_states=ref, activation="silu", seq_lens_cpu=[p])
        assert torch.equal(conv[slot], ref[3]), f"tap at {p}"

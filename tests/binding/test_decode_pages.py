"""patches/decode_pages.py: a decode step that starts no page gets the slots SGLang's paged
allocation gives (its kernel, on the real allocator), without evicting or taking a page; a
step that starts a page goes SGLang's way."""
from __future__ import annotations

import pytest
from sglang_harness import PAGE, build_cache

torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

from hpc_radix.patches.state import STATE  # noqa: E402


def _decode_step(h, lens):
    """Requests holding ``lens`` tokens in freshly allocated pages: the arguments SGLang's
    ``alloc_for_decode`` passes for their next decode step."""
    rows = torch.arange(len(lens))
    for row, n in enumerate(lens):
        slots = h.allocator.alloc(-(-n // PAGE) * PAGE)
        h.req_pool.req_to_token[row, :n] = slots[:n].to(torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int64)
    last_loc = h.req_pool.req_to_token[rows, seq_lens - 1]
    return dict(tree_cache=h.cache, seq_lens=seq_lens + 1, seq_lens_cpu=seq_lens + 1,
                last_loc=last_loc, token_per_req=1, req_pool_indices=rows,
                batch=None)


@pytest.fixture
def active(monkeypatch):
    from hpc_radix.patches import decode_pages

    monkeypatch.setattr(STATE, "decode_pages", True)
    return decode_pages


def _orig_counted(calls):
    from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_decode

    def orig(*args, **kwargs):
        calls.append(args)
        return alloc_paged_token_slots_decode(*args, **kwargs)
    return orig


def test_no_page_started_gives_sglangs_slots_without_allocating(server_args, active):
    from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_decode

    h = build_cache(server_args)
    step = _decode_step(h, [10, PAGE + 5, 2 * PAGE + 2, PAGE - 1])     # none at a page's end
    free = h.allocator.available_size()
    calls = []
    fast = active._around_alloc_decode(_orig_counted(calls), **step)
    assert not calls and h.allocator.available_size() == free
    want = alloc_paged_token_slots_decode(**step)                       # SGLang's kernel
    assert fast.dtype == want.dtype == torch.int64 and fast.tolist() == want.tolist()
    assert h.allocator.available_size() == free


def test_a_started_page_goes_sglangs_way(server_args, active):
    h = build_cache(server_args)
    step = _decode_step(h, [10, PAGE, 3])                              # the second fills its page
    free = h.allocator.available_size()
    calls = []
    out = active._around_alloc_decode(_orig_counted(calls), **step)
    assert len(calls) == 1 and h.allocator.available_size() == free - PAGE
    assert out[1].item() % PAGE == 0 and out[0].item() == step["last_loc"][0].item() + 1


def test_inactive_or_multi_token_steps_go_sglangs_way(server_args, active, monkeypatch):
    h = build_cache(server_args)
    step = _decode_step(h, [10, 20])
    calls = []
    active._around_alloc_decode(_orig_counted(calls), **{**step, "token_per_req": 2,
                                                         "seq_lens": step["seq_lens"] + 1,
                                                         "seq_lens_cpu": step["seq_lens_cpu"] + 1})
    monkeypatch.setattr(STATE, "decode_pages", False)
    active._around_alloc_decode(_orig_counted(calls), **step)
    assert len(calls) == 2


def test_starts_a_page_matches_sglangs_count():
    from sglang.srt.utils.common import get_num_new_pages

    from hpc_radix.patches.decode_pages import starts_a_page

    for lens in ([1], [2, 3], [65, 7], [64, 128], [129], [63, 64, 66]):
        t = torch.tensor(lens, dtype=torch.int64)
        assert starts_a_page(t, PAGE) == (get_num_new_pages(t, PAGE, decode=True) > 0), lens

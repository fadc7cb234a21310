"""Real SGLang 0.5.17 pools on CPU tensors and a harness that calls HybridRadixCache in the
order SGLang's scheduler does (match, lock, admit, extend chunks, decode, finish / abort)."""
from __future__ import annotations

import os
from array import array
from unittest import mock
from dataclasses import dataclass

import pytest

from hpc_radix.index import check_invariants
from hpc_radix.sglang_version import checkpoints, prefix_len, req_slots

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("sglang")

CHECKPOINTS = checkpoints()   # the release's cache contract (sglang_version)
PAGE = 64
KV_PAGES = 48
REQS = 8
MAMBA_SLOTS = 24
FULL_LAYERS = [3]
MAMBA_LAYERS = [0, 1, 2]

TINY_CONFIG = """{"architectures": ["LlamaForCausalLM"], "model_type": "llama",
 "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
 "num_key_value_heads": 2, "head_dim": 32, "num_hidden_layers": 2,
 "vocab_size": 256, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
 "torch_dtype": "bfloat16", "tie_word_embeddings": false}"""


def make_server_args(model_dir, *extra: str):
    """SGLang ServerArgs for a CPU run on a tiny config written to ``model_dir``; also the
    scheduler's global server args."""
    from sglang.srt.server_args import prepare_server_args, set_global_server_args_for_scheduler

    with open(os.path.join(model_dir, "config.json"), "w") as f:
        f.write(TINY_CONFIG)
    args = prepare_server_args(["--model-path", str(model_dir), "--device", "cpu",
                                "--page-size", str(PAGE), "--skip-tokenizer-init", *extra])
    set_global_server_args_for_scheduler(args)
    if checkpoints():      # what a one-GPU scheduler process writes when it builds its groups
        from sglang.srt.runtime_context import get_parallel

        get_parallel().override_permanently(tp_rank=0, pp_rank=0)
    return args


def model_with_weights(model_dir):
    """``make_server_args`` for a model directory that also has a weights file (whose name,
    size and bytes the cache's fingerprints read)."""
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "model.safetensors"), "wb") as f:
        f.write(b"\0" * 64)
    return make_server_args(model_dir)


def ramp_prompt(n, seed=0):
    """``n`` tokens of a deterministic ramp (``seed`` shifts it)."""
    return [(seed * 7919 + i * 31) % 250 + 1 for i in range(n)]


@pytest.fixture(scope="session")
def server_args(tmp_path_factory):
    return make_server_args(tmp_path_factory.mktemp("tiny-config"))


def _cache_params(mamba_heads=4):
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape

    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=8 * mamba_heads, n_groups=2,
                                    num_heads=mamba_heads, head_dim=8, state_size=8, conv_kernel=4)
    return Mamba2CacheParams(shape=shape, layers=MAMBA_LAYERS)


def make_pools(kv_pages=KV_PAGES, mamba_slots=MAMBA_SLOTS, max_context_len=4096, reqs=REQS,
               device="cpu", mamba_heads=4):
    """SGLang's real pools (on CPU tensors unless ``device``): (request pool with its mamba
    pool, KV pool, KV page allocator). ``mamba_heads`` sets the state image's size against a
    KV block's (4: about one block; 148: about 37, as in the large16 model)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool

    req_pool = HybridReqToTokenPool(
        size=reqs, mamba_size=mamba_slots, mamba_spec_state_size=reqs, max_context_len=max_context_len,
        device=device, enable_memory_saver=False, cache_params=_cache_params(mamba_heads),
        mamba_layer_ids=MAMBA_LAYERS, enable_mamba_extra_buffer=True,
        speculative_num_draft_tokens=None)
    kv_pool = HybridLinearKVPool(
        size=kv_pages * PAGE, dtype=torch.bfloat16, page_size=PAGE, head_num=2, head_dim=8,
        full_attention_layer_ids=FULL_LAYERS, device=device, mamba_pool=req_pool.mamba_pool,
        enable_memory_saver=False)
    allocator = PagedTokenToKVPoolAllocator(size=kv_pages * PAGE, page_size=PAGE,
                                            dtype=torch.bfloat16, device=device,
                                            kvcache=kv_pool, need_sort=False)
    return req_pool, kv_pool, allocator


def sglang_add_one_req(adder, req, *args):
    """SGLang's own ``PrefillAdder.add_one_req`` (unwrapped where a test applied the plugin's
    hooks, which wrap it in place), so a test calls the adder hook itself exactly once."""
    from sglang.srt.managers.schedule_policy import PrefillAdder

    own = getattr(PrefillAdder.add_one_req, "__wrapped__", PrefillAdder.add_one_req)
    return own(adder, req, *args)


def sglang_init_next_round_input(req, *args, **kwargs):
    """SGLang's own ``Req.init_next_round_input`` (unwrapped as ``sglang_add_one_req`` is),
    for callers that go through the plugin's hook themselves, or test where it did not apply."""
    from sglang.srt.managers.schedule_batch import Req

    own = getattr(Req.init_next_round_input, "__wrapped__", Req.init_next_round_input)
    return own(req, *args, **kwargs)


def build_cache(server_args, *, kv_pages=KV_PAGES, mamba_slots=MAMBA_SLOTS, env=None,
                disable=False, chunk=128, max_context_len=4096, reqs=REQS, enable_metrics=False,
                mamba_heads=4, tp=(0, 1, None), zero_split=False, warmed_up=True, markers=None):
    """A HybridRadixCache over real pools on CPU, in a Harness; ``tp``: (rank, size, the TP
    CPU group) when it plays one rank of a tensor-parallel server. ``zero_split``: taps
    captured in the pass, as where the GDN hooks are live (the harness's forward_taps then
    plays the pass); ``warmed_up``: as after SGLang's warm-up request (no throwaway tap);
    ``markers``: the ChatML markers the tokenizer would give."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext

    from hpc_radix.binding.contract import cache_class
    from hpc_radix.binding.hints import markers_from_tokenizer_dir
    from hpc_radix.binding.server_args import speculates
    from hpc_radix.patches import gdn_taps

    req_pool, _, allocator = make_pools(kv_pages, mamba_slots, max_context_len, reqs,
                                        mamba_heads=mamba_heads)
    params = CacheInitParams(disable=disable, req_to_token_pool=req_pool,
                             token_to_kv_pool_allocator=allocator, page_size=PAGE,
                             enable_mamba_extra_buffer=True, chunked_prefill_size=chunk,
                             enable_metrics=enable_metrics, tp_cache_group=tp[2])
    release_only = {"effective_chunked_prefill_size": chunk}     # 0.5.17's (params has it too)
    ctx = TreeCacheBuildContext(
        server_args=server_args, params=params, is_hybrid_swa=False, is_hybrid_ssm=True,
        enable_hierarchical_cache=False, disable_radix_cache=disable, tp_worker=None,
        model_config=None, tp_size=tp[1], tp_rank=tp[0], tp_group=tp[2],
        **{k: v for k, v in release_only.items() if k in TreeCacheBuildContext.__dataclass_fields__})
    if int((env or {}).get("HPC_HOST_CACHE_MIB", "0")) and os.environ.get("TRITON_INTERPRET") != "1":
        # the pools here are CPU tensors: the host tier's Triton copies run on them only under
        # the interpreter (tests/conftest.py sets it where there is no GPU, as in CI)
        pytest.skip("host tier on CPU pools needs TRITON_INTERPRET=1 (set on machines without CUDA)")
    old = dict(os.environ)
    os.environ.update({"HPC_HOST_CACHE_MIB": "0", **(env or {})})   # device tier unless asked
    path = (True, "captured by the test harness's pass") if zero_split else None
    try:
        with mock.patch("hpc_radix.patches.gdn_taps.zero_split_path",
                        lambda option, runner, real=gdn_taps.zero_split_path: path or real(option, runner)), \
                mock.patch("hpc_radix.binding.cache.markers_from_tokenizer_dir",
                           lambda d, real=markers_from_tokenizer_dir: markers or real(d)):
            h = Harness(cache_class()(ctx))
    finally:
        os.environ.clear()
        os.environ.update(old)
    if not speculates(getattr(server_args, "speculative_algorithm", None)) and not disable:
        h.cache.attach_draft_kv(None)        # as SGLang's hook calls it, with no draft worker
    h.cache.taps.warmed_up = warmed_up or not zero_split
    return h


@dataclass
class Step:
    """A forward the harness pretends to run: the extend range and its tracked position."""
    start: int
    end: int


class Harness:
    """Drives the cache like SGLang's scheduler; no model runs, so every state slot is filled
    with a recognisable value (its frontier) to check which state a request resumes from."""

    def __init__(self, cache):
        self.cache = cache
        self.req_pool = cache.req_to_token_pool
        self.allocator = cache.token_to_kv_pool_allocator
        self.kv = self.allocator.get_kvcache()
        self.mamba = self.req_pool.mamba_pool
        self._rid = 0

    # -- requests -------------------------------------------------------------------------
    def new_req(self, tokens, max_new_tokens=16):
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        self._rid += 1
        return Req(rid=f"r{self._rid}", origin_input_text="",
                   origin_input_ids=array("q", tokens),
                   sampling_params=SamplingParams(max_new_tokens=max_new_tokens))

    def admit(self, req):
        """match_prefix(cow_mamba) -> PrefillAdder locks (and loads host hits back) ->
        admitted -> slots allocated."""
        req.init_next_round_input(self.cache)
        return self.admit_locked(req)

    def admit_locked(self, req):
        """The PrefillAdder's part, for a request matched already (under either release's
        cache contract: sglang_version.checkpoints)."""
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams

        if CHECKPOINTS:
            temporary = self.cache.lock(req.last_node)  # PrefillAdder._lock_node
            if req.needs_host_load_back():
                loaded, req.last_node = self.cache.init_load_back(InitLoadBackParams(
                    best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req))
                req.prefix_len += loaded
            req.lock = self.cache.lock(req.last_node)  # _commit_prefill_admission
            self.cache.unlock(temporary)
            return self.place(req)
        self.cache.inc_lock_ref(req.last_node)      # PrefillAdder._lock_node (temporary)
        if req.needs_host_load_back():              # PrefillAdder.add_one_req
            new, req.last_node = self.cache.init_load_back(InitLoadBackParams(
                best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req))
            req.prefix_indices = torch.cat([req.prefix_indices, new])
        self.cache.inc_lock_ref(req.last_node)      # _req_inc_lock_ref (held)
        self.cache.dec_lock_ref(req.last_node)      # temporary lock released
        return self.place(req)

    def place(self, req):
        """An admitted request (its lock held, its prefix loaded back): its private tail page,
        slots, token row and working state, as SGLang sets them up before the forward."""
        from sglang.srt.managers.schedule_batch import ReqKvInfo
        from sglang.srt.mem_cache.allocation import alloc_req_slots

        self.cache.on_admitted(req)
        alloc_req_slots(self.req_pool, [req], self.cache)   # evicts mamba slots when short
        prefix = prefix_len(req)
        row = self.row(req)
        row[:prefix] = self.prefix(req)
        if CHECKPOINTS:
            req.kv.kv_allocated_len = prefix
        else:
            req.kv = ReqKvInfo(kv_allocated_len=prefix, swa_evicted_seqlen=0)
        req_slots(req).kv_committed_len = prefix
        self._resume_state(req)
        return prefix

    def prefix(self, req):
        """The token slots of ``req``'s matched (and loaded) prefix, as SGLang has them."""
        return self.cache.prefix_device_indices(req) if CHECKPOINTS else req.prefix_indices

    def row(self, req):
        """The request's token row."""
        return self.req_pool.req_to_token[req_slots(req).req_pool_idx]

    def _resume_state(self, req):
        """What ModelRunner does before the first layer: COW or clear the working slot (or
        neither: a host restore wrote it)."""
        kv = req_slots(req)
        slot = int(kv.mamba_pool_idx)
        temporal = self.mamba.mamba_cache.temporal
        if kv.mamba_cow_src_index is not None:
            temporal[:, slot] = temporal[:, int(kv.mamba_cow_src_index[0])]
            kv.mamba_cow_src_index = None
        elif kv.mamba_needs_clear:
            temporal[:, slot] = 0
        kv.mamba_needs_clear = False

    def _alloc(self, req, end):
        """Allocate KV for positions [allocated, end) like the paged allocator: fill the
        partial last page, then whole new pages."""
        row = self.row(req)
        start = req.kv.kv_allocated_len
        pos = start
        while pos < end:
            if pos % PAGE == 0:
                page = self.allocator.alloc(PAGE)
                if page is None:
                    self.evict(num_tokens=PAGE)
                    page = self.allocator.alloc(PAGE)
                assert page is not None, "out of KV pages"
                base = int(page[0])
            else:
                base = int(row[pos - 1]) + 1 - pos % PAGE
            n = min(end, pos - pos % PAGE + PAGE) - pos
            row[pos:pos + n] = torch.arange(base + pos % PAGE, base + pos % PAGE + n)
            pos += n
        req.kv.kv_allocated_len = max(start, end)

    def prefill_chunk(self, req, end, final):
        """One extend [len(prefix), end), with extra_buffer tracking as SGLang plans it and,
        zero-split, the taps the pass captures."""
        kv = req_slots(req)
        start = prefix_len(req)
        self.set_extend(req, start, end)
        self._alloc(req, end)
        kv.kv_committed_len = end
        self.forward_taps([(req, start, end)])
        extend = end - start
        if extend >= PAGE:                         # _mamba_radix_cache_v2_req_prepare_for_extend
            self._track(req, start + extend // PAGE * PAGE)
        self.mamba.mamba_cache.temporal[:, int(kv.mamba_pool_idx)] = float(end)
        self._write_kv(req, start, end)
        if CHECKPOINTS:
            from sglang.srt.mem_cache.common import checkpoint_kv_cache

            checkpoint_kv_cache(req, self.cache)                 # either way: SGLang's call
        elif not final:
            self.cache.cache_unfinished_req(req, chunked=True)   # stash_chunked_request
        else:
            self.cache.cache_unfinished_req(req)                 # end of prefill, decode next

    @staticmethod
    def set_extend(req, start, end):
        """The coming pass extends ``req`` over [start, end) (SGLang's extend range; from
        0.5.23 its end only, the start being its prefix)."""
        if CHECKPOINTS:
            assert start == prefix_len(req), (start, prefix_len(req))
            req.extend_end = end
        else:
            req.set_extend_range(start, end)

    @staticmethod
    def extend_of(req) -> tuple:
        """(start, end) of the extend SGLang's adder gave ``req``."""
        if CHECKPOINTS:
            return prefix_len(req), req.extend_end
        return req.extend_range.start, req.extend_range.end

    @staticmethod
    def loaded(load_back) -> int:
        """The tokens an ``init_load_back`` answer loaded (slots up to 0.5.22, a count from 0.5.23)."""
        return load_back if isinstance(load_back, int) else load_back.numel()

    def _track(self, req, at):
        """The state at ``at`` left in the next ping-pong tracking slot, which becomes the
        keep slot."""
        kv = req_slots(req)
        idx = kv.mamba_next_track_idx
        self.mamba.mamba_cache.temporal[:, int(kv.mamba_ping_pong_track_buffer[idx])] = float(at)
        if CHECKPOINTS:
            kv.mamba_last_track_idx = idx
        kv.mamba_next_track_idx = self.req_pool.get_mamba_ping_pong_other_idx(idx)
        kv.mamba_last_track_seqlen = at

    def forward_taps(self, rows):
        """What the ForwardBatch hook and the GDN pass do with a batch of (req, start, end):
        reserve the taps' slots, then fill each with its state (its frontier)."""
        from types import SimpleNamespace

        batch = SimpleNamespace(reqs=[r for r, _, _ in rows], prefix_lens=[s for _, s, _ in rows],
                                extend_lens=[e - s for _, s, e in rows])
        plan = self.cache.reserve_taps(batch)
        self.cache.batch_built()
        for row, rel, slot in (plan.taps if plan is not None else ()):
            self.mamba.mamba_cache.temporal[:, slot] = float(rows[row][1] + rel)
        return plan

    def _write_kv(self, req, start, end):
        """KV of a position = its token id, so tests can read back what a page holds (a
        speculative draft model's: its negative, minus one)."""
        row = self.row(req)
        toks = (req.origin_input_ids + req.output_ids)
        k = self.kv.full_kv_pool.k_buffer[0]
        drafts = [pool.full_kv_pool.k_buffer[0] for pool in self.cache.pool.kv_pools[1:]]
        for p in range(start, end):
            k[int(row[p])] = float(toks[p] % 251)
            for draft_k in drafts:
                draft_k[int(row[p])] = -float(toks[p] % 251) - 1

    def prefill(self, req, chunk=128):
        self.admit(req)
        self.prefill_rest(req, chunk)

    def prefill_rest(self, req, chunk=128):
        """An admitted request's prompt from its prefix on, cut as SGLang's chunked prefill
        cuts it: chunks of ``chunk`` tokens from the page its prefix ends in, then the rest."""
        n = len(req.origin_input_ids)
        while n - prefix_len(req) > chunk:
            self.prefill_chunk(req, prefix_len(req) // PAGE * PAGE + chunk, final=False)
        self.prefill_chunk(req, n, final=True)

    def decode(self, req, tokens, overlap=True):
        """Decode steps; with overlap one more forward is launched (committed) after the last
        sampled token, as SGLang's overlap scheduler does."""
        for t in tokens:
            req.output_ids.append(t)
        steps = len(tokens) - (0 if overlap else 1)
        kv = req_slots(req)
        for _ in range(steps):
            pos = kv.kv_committed_len
            self._alloc(req, pos + 1)
            self.cache.batch_built()
            kv.kv_committed_len = pos + 1
            self._write_kv(req, pos, pos + 1)
        self.mamba.mamba_cache.temporal[:, int(kv.mamba_pool_idx)] = float(kv.kv_committed_len)

    def verify_step(self, req, drafts, accepted, track_interval=256):
        """One speculative decode step as SGLang's EAGLE worker runs it: the verify pass writes
        KV for the last token and ``drafts`` drafted ones, of which ``accepted`` pass and a
        bonus token follows; the rejected positions keep garbage KV (250) and stay allocated
        beyond the committed length until the request ends. A step that crosses a multiple of
        ``track_interval`` (--mamba-track-interval) leaves the state there in the next
        ping-pong slot, which becomes the keep slot (``_mamba_prefix_cache_update``)."""
        kv = req_slots(req)
        pos = kv.kv_committed_len
        self._alloc(req, pos + drafts + 1)
        self.cache.batch_built()
        for _ in range(accepted + 1):
            req.output_ids.append(7 + len(req.output_ids) % 5)
        self._write_kv(req, pos, pos + accepted + 1)
        row = self.row(req)
        self.kv.full_kv_pool.k_buffer[0][row[pos + accepted + 1:pos + drafts + 1].long()] = 250.0
        kv.kv_committed_len = pos + accepted + 1
        self.mamba.mamba_cache.temporal[:, int(kv.mamba_pool_idx)] = float(kv.kv_committed_len)
        crossed = kv.kv_committed_len // track_interval * track_interval
        if crossed > pos:
            self._track(req, crossed)

    @staticmethod
    def speculating():
        """SGLang's resolved config under EAGLE / NEXTN for the block: its request release then
        frees the draft positions allocated beyond the committed tokens (``verify_step``)."""
        from sglang.srt.runtime_context import get_spec
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        return get_spec().override(speculative_algorithm=SpeculativeAlgorithm.EAGLE)

    def attach_draft(self, overlapped=False):
        """SGLang's draft worker built: a one-layer KV pool over the target's slots, as the MTP
        head's, handed over by the plugin's hook as SGLang calls it once the tree cache is
        built (a V2 worker holds its runner; the worker itself needs a GPU), for a server
        scheduling with overlap when ``overlapped``. Returns the pool."""
        if CHECKPOINTS:
            pytest.skip("speculative decoding is refused on SGLang 0.5.23 (not ported)")
        from types import SimpleNamespace

        from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

        from hpc_radix.patches.scheduler_hooks import _after_register_draft

        pool = HybridLinearKVPool(size=self.allocator.size, dtype=torch.bfloat16, page_size=PAGE,
                                  head_num=2, head_dim=8, full_attention_layer_ids=[0],
                                  device=self.allocator.device, mamba_pool=self.mamba,
                                  enable_memory_saver=False)
        runner = SimpleNamespace(token_to_kv_pool=pool)
        _after_register_draft(None, tree_cache=self.cache, spec_algorithm=SpeculativeAlgorithm.EAGLE,
                              draft_worker=SimpleNamespace(draft_worker=SimpleNamespace(draft_runner=runner)),
                              server_args=SimpleNamespace(enable_multi_layer_eagle=False,
                                                          disable_overlap_schedule=not overlapped))
        return pool

    def finish(self, req, is_insert=True):
        from sglang.srt.mem_cache.common import release_kv_cache

        if CHECKPOINTS:
            from sglang.srt.managers.schedule_batch import FINISH_LENGTH

            if req.kv.holds_kv and req.kv.kv_allocated_len == 0:
                # let go before its first pass: 0.5.23 allocates (and counts committed) the
                # first extend's slots with the row, and its release holds a row with nothing
                # in it for a double release
                self._alloc(req, min(PAGE, len(req.origin_input_ids)))
                req.kv.kv_committed_len = req.kv.kv_allocated_len
            if is_insert and not req.finished():
                req.finished_reason = FINISH_LENGTH(length=len(req.output_ids))
            release_kv_cache(req, self.cache, checkpoint=is_insert)
        else:
            release_kv_cache(req, self.cache, is_insert=is_insert)

    def serve(self, req, output=(1,), chunk=128):
        """A whole request: admit, prefill in chunks, decode ``output``, finish."""
        self.prefill(req, chunk=chunk)
        self.decode(req, list(output))
        self.finish(req)

    def complete(self, req, output=(1,)):
        """An admitted request: prefill the rest in one final chunk, decode, finish."""
        self.prefill_chunk(req, len(req.origin_input_ids), final=True)
        self.decode(req, list(output))
        self.finish(req)

    def evict(self, **kw):
        """SGLang's eviction call (EvictParams fields as keywords)."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        return self.cache.evict(EvictParams(**kw))

    def evict_all(self):
        """Device pressure from elsewhere: every evictable page and slot goes."""
        return self.evict(num_tokens=self.cache.full_evictable_size(),
                          mamba_num=self.cache.mamba_evictable_size())

    # -- checks ---------------------------------------------------------------------------
    def check_idle(self):
        """SGLang's idle invariant checker: pages and slots conserved exactly."""
        c = self.cache
        assert (self.allocator.available_size() + c.full_evictable_size()
                + c.full_protected_size()) == self.allocator.size
        assert (self.req_pool.mamba_allocator.available_size() + c.mamba_evictable_size()
                + c.mamba_protected_size()) == self.mamba.size
        assert c.full_protected_size() == 0 and c.mamba_protected_size() == 0
        assert len(self.req_pool.free_slots) == self.req_pool.size
        c.sanity_check()
        check_invariants(c.index)

    def state_of(self, slot):
        return float(self.mamba.mamba_cache.temporal[0, slot].flatten()[0])


NEXTN_FLAGS = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2",
               "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3",
               "--disable-overlap-schedule")


@pytest.fixture
def speculative_args(tmp_path_factory, server_args):
    """``make_server_args`` as SGLang resolves the MTP head's speculative decoding (NEXTN, one
    draft path); the scheduler's global server args are the session's again afterwards."""
    if CHECKPOINTS:
        pytest.skip("speculative decoding is refused on SGLang 0.5.23 (not ported)")
    from sglang.srt.server_args import set_global_server_args_for_scheduler

    model_dir = tmp_path_factory.mktemp("tiny-config-nextn")
    def make(model=model_dir):
        return make_server_args(model, *NEXTN_FLAGS)
    yield make
    set_global_server_args_for_scheduler(server_args)


@pytest.fixture
def harness(server_args):
    return build_cache(server_args, env={"HPC_CACHE_FULL_CHECK": "1"})


@pytest.fixture
def hosted(server_args):
    """A cache with a 1 MiB host tier (256 slabs of 4 KiB over the harness pools), pinned."""
    h = build_cache(server_args, env={"HPC_CACHE_FULL_CHECK": "1", "HPC_HOST_CACHE_MIB": "1",
                                      "HPC_HOST_WRITE_THRESHOLD": "0"})   # writes from the start
    assert h.cache.host.memory.wait(60)
    h.cache._poll_host()
    yield h
    h.cache.release_host_resources()

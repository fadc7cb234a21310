"""Every SGLang method patches/ hooks exists, under the name the installed release gives it
(sglang_version.target): a hook whose target moved would otherwise never fire. Runs on every
SGLang release scripts/test.sh tests."""
from __future__ import annotations

import importlib

import pytest

pytest.importorskip("sglang")

from hpc_radix import sglang_version  # noqa: E402

PATCHES = ("scheduler_hooks", "batch_syncs", "gdn_taps", "decode_pages", "state_copy")


def hook_targets() -> set[str]:
    """The TARGET / *_TARGET / TARGETS constants of every patch module."""
    out = set()
    for name in PATCHES:
        module = importlib.import_module(f"hpc_radix.patches.{name}")
        for attr, value in vars(module).items():
            if attr == "TARGETS":
                out.update(value)
            elif attr == "TARGET" or attr.endswith("_TARGET"):
                out.add(value)
    return out


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_hook_target_resolves_on_the_installed_release():
    targets = hook_targets()
    assert len(targets) >= 14
    assert [t for t in sorted(targets) if not resolves(t)] == [], sglang_version.installed()


def test_a_moved_target_is_asked_for_by_its_old_name():
    old = "sglang.srt.managers.schedule_policy.PrefillAdder._req_inc_lock_ref"
    assert sglang_version.target(old, "0.5.17") == old
    assert sglang_version.target(old, "0.5.23").endswith("._commit_prefill_admission")
    assert sglang_version.target("sglang.srt.managers.scheduler.Scheduler.on_idle", "0.5.23") \
        == "sglang.srt.managers.scheduler.Scheduler.on_idle"


SLOT_FIELDS = ("req_pool_idx", "mamba_pool_idx", "mamba_cow_src_index", "mamba_needs_clear",
               "mamba_ping_pong_track_buffer", "mamba_last_track_seqlen", "mamba_next_track_idx",
               "cache_protected_len", "kv_committed_len")


def test_a_requests_slot_fields_are_where_the_installed_release_keeps_them():
    """The cache reads and writes these through ``req_slots`` only: on the request up to
    0.5.22, on its ``kv`` from 0.5.23 (a real Req of the installed release)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req("r", "", [1, 2, 3], SamplingParams())
    slots = sglang_version.req_slots(req)
    assert [f for f in SLOT_FIELDS if not hasattr(slots, f)] == [], sglang_version.installed()
    assert sglang_version.req_slots(req, "0.5.17") is req
    assert sglang_version.req_slots(req, "0.5.23") is req.kv

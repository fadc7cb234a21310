"""The exceptions more than one layer raises or catches, in one place: ``patches/`` and the
index catch them without importing the binding. Pure Python."""
from __future__ import annotations


class OptionError(ValueError):
    """A hybrid option has an unusable value; the message names the flag."""


class HybridConfigError(ValueError):
    """The configuration cannot run the hybrid prefix cache; the message says why."""


class CacheFileError(ValueError):
    """The cache file cannot be used; the message says why (the cache then starts cold)."""


class RestoreRefused(RuntimeError):
    """A restore that cannot run where SGLang's PrefillAdder counted the source's leading device
    blocks as cached: a cold prefill would need them again, beyond its budget (SGLang's prefill
    allocation would then fail). The adder hook passes the request over for this round; its
    next match leaves host data out."""


class StoreObjectError(ValueError):
    """An object read from the shared tier cannot be used (torn, damaged, another model's or
    another key's): a miss, never an output; the message says why."""

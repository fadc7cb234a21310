"""benchmarks/micro/tap_split_sim.py: the pressure trace replayed through the real cache."""
from benchmarks.micro import tap_split_sim


def test_echoing_clients_cost_fewer_prefill_passes(server_args):
    with_rule = tap_split_sim.simulate(server_args, mix="pressure", scale=0.03)["all"]
    without = tap_split_sim.simulate(server_args, mix="pressure", scale=0.03, ignore_echo=True)["all"]
    assert with_rule["requests"] == without["requests"] == 218
    # every prompt fits one 8192-token chunk: one pass per request plus one per split
    for s in (with_rule, without):
        assert s["passes"] == s["requests"] + s["splits"]
        assert 0 < s["cached"] < s["prompt"]
    # the opener is not tapped for clients that send their outputs back
    assert with_rule["split at opener"] < without["split at opener"]
    assert with_rule["passes"] < without["passes"]

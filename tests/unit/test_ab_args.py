"""benchmarks/ab.py's command line: --host-mib for every regime or per regime."""
from __future__ import annotations

import pytest

from benchmarks import ab


def test_host_mib_per_regime_or_for_all():
    a = ab.parse(["--host-mib", "host=3909,host-tight=1978", "--regimes", "host,host-tight,ample"])
    assert ab.host_mib_for(a, "host", {}, None) == (3909, "--host-mib")
    assert ab.host_mib_for(a, "host-tight", {}, None) == (1978, "--host-mib")
    assert ab.host_mib_for(a, "ample", {}, None)[1] == "computed from --hicache-size"
    assert ab.host_mib_for(ab.parse(["--host-mib", "512"]), "host", {}, None) == (512, "--host-mib")
    assert ab.host_mib_for(a, "device", {}, None) == (0, "regime table")


@pytest.mark.parametrize("bad", ["hots=12", "host=big", "host=", "-5"])
def test_a_bad_host_mib_names_the_problem(bad, capsys):
    with pytest.raises(SystemExit):
        ab.parse(["--host-mib", bad])
    assert "--host-mib" in capsys.readouterr().err


def test_the_deadline_check_learns_from_the_servers_started_so_far():
    assert ab._time_needed({"server": [], "replay": []}, 2) == 120.0
    # the latest start (the first one compiled), the slowest replay, one replay per regime
    assert ab._time_needed({"server": [131, 97, 70], "replay": [10.7, 8.2]}, 2) == 70 + 2 * 10.7 + 15

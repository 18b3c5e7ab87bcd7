"""A benchmark target counts as met only where the 95% interval over its repeats lies within
it (``benchmarks.common``); the summary of the committed result files says so row by row."""

from __future__ import annotations

from benchmarks.__main__ import RESULTS, summarize
from benchmarks.common import MET, MISSED, UNKNOWN, quantile_verdict, ratio_interval, verdict


def test_a_ratio_inside_the_runs_spread_is_not_established():
    spread = [(1.026, 1), (0.878, 1), (1.223, 1), (0.937, 1), (1.245, 1), (1.092, 1), (1.113, 1), (0.897, 1)]
    interval = ratio_interval(spread)
    assert interval is not None and interval[1] < 1.02 < interval[2]
    assert verdict(interval, 1.02) == UNKNOWN
    assert verdict(ratio_interval([(1.70, 1), (1.75, 1), (1.66, 1)]), 1.5, at_most=False) == MET
    assert verdict(ratio_interval([(1.10, 1), (1.11, 1), (1.11, 1)]), 1.5, at_most=False) == MISSED
    assert verdict(ratio_interval([(1.0, 1)]), 1.5) == UNKNOWN  # one repeat: no interval


def test_a_p99_target_needs_enough_samples_to_be_met():
    assert quantile_verdict([1.0] * 20, 2.0) == UNKNOWN  # all under, but 20 cannot establish a p99
    assert quantile_verdict([1.0] * 298, 2.0) == UNKNOWN
    assert quantile_verdict([1.0] * 299, 2.0) == MET
    assert quantile_verdict([12.0] * 4 + [10.0] * 6, 11.0) == MISSED


def test_the_summary_of_the_result_files_meets_a_target_only_within_its_interval():
    rows = {row["target"]: row for row in summarize(RESULTS)["targets"]}
    assert rows["dp.fit epoch <= 1.02x plain DDP (CPU, 2 ranks)"]["verdict"] == UNKNOWN
    for row in rows.values():
        assert row["met"] is {MET: True, MISSED: False}.get(row["verdict"])
        if "one run" in row["measured"]:
            assert row["verdict"] == UNKNOWN, row


def test_the_swarm_runs_node_shapes_through_relays_and_keys_them_by_shape(tmp_path):
    """``benchmarks.swarm --shapes``: our transport through real node relays (ranks as threads
    with relay:// channels, or as local-leg clients of one thread per node), TCPStore beside it
    with as many clients; the result keyed by transport, then by shape."""
    import json
    import subprocess
    import sys

    for ranks_as in ("threads", "objects"):
        out = tmp_path / f"{ranks_as}.json"
        argv = ["--shapes", "2x2", "--kinds", "zmq", "TCPStore add+wait", "--procs", "2", "--barriers", "3"]
        subprocess.run(
            [sys.executable, "-m", "benchmarks.swarm", *argv, "--ranks-as", ranks_as, "--out", str(out)],
            check=True,
            capture_output=True,
            timeout=240,
        )
        result = json.loads(out.read_text())
        said = "relay:// ranks (threads)" if ranks_as == "threads" else "local-leg clients of one thread"
        assert said in result["layout"], result["layout"]
        for kind in ("zmq", "TCPStore add+wait"):
            run = result["result"][kind]["2x2"]
            assert "error" not in run, run
            assert run["rendezvous_s"] > 0 and run["barrier_ms"] > 0, run


def test_the_fault_matrix_names_the_rank_each_fault_hit(tmp_path):
    """``benchmarks.fault_matrix``, one trial of three faults on zmq (four ranks on three
    hosts of a private network, an observer on a fourth): each names the rank it hit, with
    its cause, within 5 s, and no other; the result is keyed by transport, then fault."""
    import json
    import subprocess
    import sys

    from netns import require_netns

    require_netns()
    out = tmp_path / "matrix.json"
    argv = ["--kinds", "zmq", "--faults", "sigstop", "data", "kill", "--trials", "1", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.fault_matrix", *argv], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    faults = json.loads(out.read_text())["kinds"]["zmq"]["faults"]
    assert list(faults) == ["sigstop", "data", "kill"], faults
    for fault, result in faults.items():
        (trial,) = result["trials"]
        assert trial["ok"] and trial["seconds"] <= 5.0 and not trial["wrong"], (fault, trial)

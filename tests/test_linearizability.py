"""The linearizability checker against histories whose verdict is known."""

from __future__ import annotations

import pytest

from dataparallel.testing.linearizability import Operation, check, check_key


def op(client, kind, args, start, end, result=None, key="k"):
    return Operation(client, key, kind, tuple(args), start, end, result)


def test_a_sequential_history_is_linearizable():
    history = [
        op(0, "set", ["1"], 0, 1),
        op(1, "get", [], 2, 3, "1"),
        op(0, "add", [2], 4, 5, 3),
        op(1, "compare_set", ["3", "9"], 6, 7, "9"),
        op(0, "compare_set", ["3", "5"], 8, 9, "9"),
        op(1, "delete", [], 10, 11, True),
        op(0, "check", [], 12, 13, False),
        op(0, "get", [], 14, 15, None),
        op(1, "compare_set", ["x", "y"], 16, 17, "x"),  # missing key, expected not empty
        op(1, "check", [], 18, 19, False),
    ]
    assert check(history).ok


def test_concurrent_operations_may_take_effect_in_either_order():
    history = [
        op(0, "set", ["1"], 0, 10),
        op(1, "get", [], 1, 2, None),
        op(2, "get", [], 3, 4, "1"),
        op(1, "add", [1], 5, 6, 2),
    ]
    assert check(history).ok


def test_a_double_add_is_caught():
    # add(1) applied twice: the second client sees 3 where 2 was the only possible value.
    history = [op(0, "add", [1], 0, 1, 1), op(1, "add", [1], 2, 3, 3)]
    report = check(history)
    assert not report.ok
    assert "NOT linearizable" in str(report)


def test_a_stale_read_is_caught():
    history = [op(0, "set", ["1"], 0, 1), op(0, "set", ["2"], 2, 3), op(1, "get", [], 4, 5, "1")]
    assert not check(history).ok


def test_a_lost_write_is_caught():
    history = [op(0, "set", ["1"], 0, 1), op(1, "get", [], 2, 3, None)]
    assert not check(history).ok


def test_a_write_applied_again_by_a_retry_is_caught():
    # The etcd defect: A's set commits, its reply is lost, B overwrites, A's retry writes again.
    history = [
        op(0, "set", ["1"], 0, 10),
        op(1, "get", [], 1, 2, "1"),
        op(1, "set", ["2"], 3, 4),
        op(1, "get", [], 11, 12, "1"),
    ]
    assert not check(history).ok


def test_an_indeterminate_write_may_apply_or_not_but_only_once():
    applied = [op(0, "set", ["1"], 0, None), op(1, "get", [], 1, 2, "1")]
    never = [op(0, "set", ["1"], 0, None), op(1, "get", [], 1, 2, None)]
    assert check(applied).ok and check(never).ok
    undone = [*applied, op(1, "get", [], 3, 4, None)]  # seen, then gone with no delete
    assert not check(undone).ok


def test_keys_are_checked_independently_and_the_report_names_the_window():
    history = [
        op(0, "set", ["1"], 0, 1, key="a"),
        op(1, "get", [], 2, 3, "1", key="a"),
        op(0, "add", [1], 0, 1, 1, key="b"),
        op(1, "add", [1], 2, 3, 1, key="b"),
    ]
    report = check(history)
    assert [k.ok for k in report.keys] == [True, False]
    text = str(report.keys[1])
    assert "key 'b'" in text and "client 1: add('b', 1) -> 1" in text


@pytest.mark.timeout(60)
def test_a_long_concurrent_history_checks_quickly():
    # 4 clients, 2000 overlapping adds on one key: linearizable, found without blowing up.
    history, value = [], 0
    for i in range(2000):
        value += 1
        history.append(op(i % 4, "add", [1], i, i + 3.5, value))
    report = check_key("k", history)
    assert report.ok, str(report)

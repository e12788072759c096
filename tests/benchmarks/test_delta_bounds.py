"""The delta benchmark's traffic bound counts the 64-byte lines a delta must touch, and its bytes follow."""

from __future__ import annotations

import torch

from benchmarks.delta_bounds import LINE, changed_lines, compare_bound_s, traffic_bound


def test_changed_lines_counts_each_64_byte_line_holding_a_change_once() -> None:
    a = torch.zeros(100, dtype=torch.bfloat16)  # 32 elements per line: lines 0-2 whole, line 3 a tail of 4
    b = a.clone()
    assert changed_lines(a, b) == 0
    b[0] = b[31] = 1  # both in line 0
    assert changed_lines(a, b) == 1
    b[32] = 1
    assert changed_lines(a, b) == 2
    b[99] = 1  # the partial last line
    assert changed_lines(a, b) == 3


def test_changed_lines_follow_the_item_size_and_compare_bits_not_values() -> None:
    a = torch.zeros(64, dtype=torch.float32)  # 16 per line
    b = a.clone()
    b[15], b[16] = 1.0, -0.0  # -0.0 == 0.0 as a value, but its bits changed
    assert changed_lines(a, b) == 2


def test_the_traffic_bound_is_both_versions_read_plus_three_streams_per_changed_line() -> None:
    a = {"x": torch.zeros(4096, dtype=torch.bfloat16), "y": torch.zeros(1000, dtype=torch.float32)}
    b = {n: t.clone() for n, t in a.items()}
    b["x"][[0, 1, 100]] = 1
    b["y"][999] = 1
    got = traffic_bound("cpu", a, b)
    assert got["changed_lines"] == 3
    assert got["traffic_bytes"] == 2 * (4096 * 2 + 1000 * 4) + 3 * 3 * LINE
    assert got["traffic_bound_s"] == got["traffic_bytes"] / max(got["read_Bps"], got["copy_Bps"])
    assert compare_bound_s("cpu", a, b) > 0

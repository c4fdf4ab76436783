"""The operations of one layer's decode step as a GPU runs it, counted from its StableHLO
(lowered for cuda on the CPU; benchmarks/decode_ops.py): a mixed state's step adds no sort,
no scatter beyond the state's own in-place writes, and no more operations than these bounds,
so that its kernel count cannot creep back (issue 65: kivi2-mix ran ~2,000 extra small
kernels a step)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import decode_ops


@pytest.fixture(scope="module")
def counts():
    return {kv: decode_ops.count_stablehlo(decode_ops.step_stablehlo(kv)) for kv in decode_ops.KVS}


def test_kivi2_step_is_its_three_kernels_and_the_merge_of_their_splits(counts):
    # the fused append, the score and the value kernels; the splits merged by 3 reductions
    assert counts["kivi2"]["custom_call"] == 3
    assert counts["kivi2"]["reduce"] == 3
    assert counts["kivi2"]["scatter"] == counts["kivi2"]["transpose"] == 0


def test_kivi2_mix_step_sorts_nothing_and_scatters_only_its_state_writes(counts):
    mix = counts["kivi2-mix"]
    assert mix["sort"] == mix["top_k"] == 0  # heavy tokens and fine channels by comparisons
    # one in-place write per state array a token enters by position: 6 codes, scales, zeros,
    # 2 rings, 2 fine-channel arrays (the sinks and heavy slots are selects over small arrays,
    # the logits' edits selects by position)
    assert mix["scatter"] <= 10
    assert mix["custom_call"] == 2  # the attention kernels; the append is XLA's


@pytest.mark.parametrize(
    "kind, bound",
    [("transpose", 15), ("gather", 14), ("dot_general", 3), ("reduce", 33),
     ("concatenate", 14), ("total", 1150)],
)  # fmt: skip
def test_kivi2_mix_step_stays_within_its_operation_counts(counts, kind, bound):
    # the counts at jax 0.10.2 (total: 1142; kivi2: 64), a little slack on the total only
    assert counts["kivi2-mix"][kind] <= bound

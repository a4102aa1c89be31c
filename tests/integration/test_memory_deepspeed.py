"""dschat.memory's model-state formulas equal DeepSpeed's own estimators (which dschat.memory may not
import: it is pure), for 16-bit training over a grid of sizes and cluster shapes."""

from __future__ import annotations

import itertools

import pytest

from dschat import memory as M


@pytest.mark.parametrize(
    ("params", "largest", "gpus", "nodes"),
    [
        (p, big, g, n)
        for (p, big), g, n in itertools.product(
            [(1_315_758_080, 102_957_056), (6_738_415_616, 131_072_000), (12_345, 678)], [1, 8], [1, 4]
        )
    ],
)
def test_model_states_equal_deepspeed_estimators(params, largest, gpus, nodes):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    for offload in (False, True):
        want = estimate_zero2_model_states_mem_needs(params, gpus, nodes, cpu_offload=offload)
        assert M.zero2_model_states(params, gpus, nodes, offload) == want
        assert M.trained_states(params, largest, M.Choice(2, offload, False), 2, gpus, nodes) == want
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            params, largest, gpus, nodes, cpu_offload=offload, cpu_offload_params=offload
        )
        assert M.zero3_model_states(params, largest, gpus, nodes, offload, offload) == (cpu, gpu)
        assert M.trained_states(params, largest, M.Choice(3, offload, False), 2, gpus, nodes) == (cpu, gpu)
    cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
        params, largest, gpus, nodes, cpu_offload=True, cpu_offload_params=False
    )
    assert M.zero3_model_states(params, largest, gpus, nodes, True, False) == (cpu, gpu)

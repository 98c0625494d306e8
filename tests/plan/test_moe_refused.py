"""tfllm plan and the GPU memory check say in one line that they do not model mixtures of
experts (their shapes, memory and collectives count a dense MLP) instead of planning a
wrong model."""

import pytest

from tests.harness import tiny_config
from tfllm.plan.fit import check_host
from tfllm.plan.planner import PlanError, plan
from tfllm.runtime.gpu_checks import Gpu

MOE = {"model.num_experts": 4, "model.moe_intermediate_dim": 32}


def test_plan_refuses_a_mixture_of_experts_before_compiling():
    with pytest.raises(PlanError, match="does not model mixtures of experts"):
        plan(tiny_config("llama", **MOE), "h100")


def test_the_memory_check_is_a_warning_not_a_wrong_estimate():
    gpu = Gpu(name="NVIDIA H100 80GB HBM3", compute_capability=(9, 0), driver="550.54")
    level, message = check_host(tiny_config("llama", **MOE), [gpu], 1)
    assert level == "warning" and "mixtures of experts" in message

"""Precision policies (fp32, bf16, fp16 + loss scaling) and FP8 ops (floor 6); which dots
of a compiled program multiply FP8 operands is `tfllm.compiler.fp8_hlo`'s reading."""
from tfllm.precision.fp8 import Fp8Settings, fp8_einsum
from tfllm.precision.policies import POLICIES, describe, fp8_settings, keras_policy

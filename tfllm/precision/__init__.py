"""Precision policies (fp32, bf16, fp16 + loss scaling), FP8 ops and the reading of FP8
dots in compiled HLO (floor 4)."""
from tfllm.precision.fp8 import Fp8Settings, fp8_einsum
from tfllm.precision.policies import POLICIES, describe, fp8_settings, keras_policy

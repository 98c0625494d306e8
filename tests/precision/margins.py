"""How far training in a lower precision may drift from the higher one: the margins
test_policies and test_fp8_moe hold the losses to."""

# Measured (12-20 steps of the tiny models, lr 3e-3): max |loss difference| bf16 vs fp32
# 0.0028, fp8 vs bf16 0.0030, fp16 vs fp32 0.0003 on losses around 3-4.8, single device
# and data=2,model=4 alike. The margins are ~3x those: bf16 rounds every activation to
# 8 significant bits (u = 2**-9 ~ 0.002 relative), FP8 operands to 4 (u = 1/16) but only
# inside the projections, whose errors average out over the 64-wide contractions.
MARGINS = {("bfloat16", "float32"): 0.01, ("fp8", "bfloat16"): 0.01,
           ("float16", "float32"): 0.002}

"""A mixture of experts' checkpoint restores into another expert layout.

The common path: `tfllm import` on one device (every expert whole on it), then
`tfllm train` on a mesh whose batch axis splits the experts (expert parallelism); and
back, a run trained with expert parallelism exported or evaluated on one device. The
checkpoint holds each stacked expert kernel whole (DTensor's checkpoints are layout-free),
so either way the restored model is the imported one: its logits are transformers'
within the dense families' tolerance (`transformers_reference.REL`: float32 on both
sides, summation orders differ; the routing is decisive, tests/pretrained/
test_moe_families.py).
"""

import numpy as np
import pytest

from tests.pretrained import helpers
from tests.pretrained import transformers_reference as ref
from tfllm.cli.main import main


@pytest.mark.slow  # an import, a mesh build and two forward passes: ~30 s under load
@pytest.mark.parametrize("name,imported,restored", [
    ("qwen3_moe", "data=1", "data=2,model=4"),  # replicated -> expert-parallel
    ("mixtral", "fsdp=4", "data=1"),  # expert-parallel over fsdp -> one device
])
def test_an_imported_checkpoint_restores_into_another_expert_layout(name, imported,
                                                                    restored, tmp_path):
    from tests.pretrained.logits import sharded_logits
    from tfllm.checkpoint.workdir import Workdir
    from tfllm.config import load_config
    from tfllm.models import build_model
    from tfllm.parallel import make_parallel
    reference = ref.save(name, tmp_path / "hf")
    ref.keras_hub_tokenizer(ref.MODELS[name][2]).save_to_preset(str(tmp_path / "tok"))
    assert main(["import", "--preset", str(tmp_path / "hf"), "--workdir",
                 str(tmp_path / "run"), "--set", f"mesh.axes={imported}",
                 "--tokenizer", str(tmp_path / "tok")]) == 0
    config = load_config(str(tmp_path / "run" / "config.yaml"), [f"mesh.axes={restored}"])
    ids = helpers.token_ids()
    if restored == "data=1":
        model = build_model(config.model, config.precision, config.lora, seed=config.train.seed)
        Workdir(str(tmp_path / "run")).restore_weights(model)
        ours = np.asarray(model(ids), np.float32)
    else:
        parallel = make_parallel(config.mesh, config.model, config.optimizer)
        model = build_model(config.model, config.precision, config.lora, parallel=parallel,
                            seed=config.train.seed)
        experts = [v for v in model.variables if v.logical_axes[0] == "experts"]
        # the stacked kernels' experts over data: two of the four per device group
        assert len(experts) == 6 and all(parallel.variable_spec(v)[0] == "data"
                                         for v in experts), [
            parallel.variable_spec(v) for v in experts]
        Workdir(str(tmp_path / "run")).restore_weights(model, parallel)
        ours = sharded_logits(model, parallel, ids)
    ref.assert_same_model(ours, ref.logits(reference, ids))

"""Pretrained models in and out: keras-hub presets and Hugging Face checkpoints.

`from_preset(dir, parallel)` builds a tfllm model holding a preset's weights (read
block by block into their DTensor layouts); `import_preset` writes a tfllm run at step 0
(`tfllm import`); `export_preset` writes a run back as a keras-hub preset
(`tfllm export --format keras-hub`). `FAMILIES` lists the supported keras-hub
architectures by class name (`tfllm.families.BACKBONES`: the families own them).
"""

from tfllm.families import BACKBONES as FAMILIES, PretrainedError, supported
from tfllm.pretrained.importer import from_preset, import_preset, load_weights

__all__ = ["FAMILIES", "PretrainedError", "from_preset", "import_preset", "load_weights",
           "supported"]

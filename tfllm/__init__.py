"""tfllm: train Keras 3 language models on TensorFlow DTensor meshes with XLA."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
#: TF_CPP_MIN_LOG_LEVEL as the user set it (None: not set; see tfllm.quiet)
USER_TF_LOG_LEVEL = os.environ.get("TF_CPP_MIN_LOG_LEVEL")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

__version__ = "0.1.0"

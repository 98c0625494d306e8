from tfllm.models.gemma3.gemma3 import Gemma3

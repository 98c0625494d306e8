from tfllm.models.llama.llama import Llama

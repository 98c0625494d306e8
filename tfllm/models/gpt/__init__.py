from tfllm.models.gpt.gpt import GPT

"""The `tfllm` command (top floor): thin entry points over train, generate, eval, export,
import, plan, layouts, launch and doctor; maps failures to `tfllm.contracts` exit codes."""

"""One trained tiny run on data=2,model=4, shared by the checkpoint tests (built once)."""

import pytest

from tests.checkpoint.helpers import build_run, gathered


@pytest.fixture(scope="session")
def source_run():
    """(parallel, variables, gathered values) after one AdamW step on data=2,model=4."""
    _, parallel, variables = build_run("data=2,model=4", train_steps=1)
    return parallel, variables, gathered(variables)

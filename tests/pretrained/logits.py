"""A model's logits on a mesh, gathered to the host: what the import tests compare with
keras-hub's and transformers'."""

from tfllm.data import feed


def sharded_logits(model, parallel, ids):
    """The model's logits on the mesh (batch over its batch axes), gathered to host."""
    import tensorflow as tf
    from tfllm.parallel import context
    from tfllm.parallel.placement import to_numpy
    batch = feed.place(parallel, ids)

    @tf.function
    def forward(x):
        with context.use(parallel):
            return model(x)
    return to_numpy(forward(batch))

"""The private Keras and keras-hub APIs tfllm's pretrained import/export uses, fenced here.

Written for Keras 3.5-3.x and keras-hub 0.20-0.x (setup.py bounds both). Each function
checks that the internal it needs exists and fails with a message naming the versions
otherwise, instead of an AttributeError in the middle of an import.

* `preset_loader`: keras-hub's loader for a preset directory (its own format or a
  Hugging Face checkpoint), which knows each format's config converter.
* `abstract_backbone`: a keras-hub backbone with paths and shapes but no memory.
* `h5_locations`: where Keras' weights file stores each variable of a layer.
* `RecordingSafetensorLoader`: runs keras-hub's Hugging Face weight converter without
  assigning anything, to learn which tensor (and which reshaping) feeds each variable.
"""

from __future__ import annotations

import keras

_WRITTEN_FOR = "Keras 3.5-3.x with keras-hub 0.20-0.x"


def _missing(what: str) -> RuntimeError:
    import keras_hub
    return RuntimeError(f"Keras {keras.__version__} / keras-hub {keras_hub.__version__} lacks "
                        f"{what}, which tfllm's pretrained import uses (written for "
                        f"{_WRITTEN_FOR}); install versions in that range.")


def preset_loader(preset: str):
    """keras-hub's `PresetLoader` for a local preset or Hugging Face directory."""
    try:
        from keras_hub.src.utils.preset_utils import get_preset_loader
    except ImportError:
        raise _missing("keras_hub.src.utils.preset_utils.get_preset_loader") from None
    return get_preset_loader(preset)


def abstract_backbone(cls, kwargs: dict):
    """`cls(**kwargs)` built under a stateless scope: variables with paths and shapes,
    no values (a llama-70b backbone costs no memory)."""
    try:
        from keras.src.backend.common import global_state
    except ImportError:
        raise _missing("keras.src.backend.common.global_state") from None
    before = list(global_state.get_global_attribute("uninitialized_variables") or [])
    with keras.StatelessScope(initialize_variables=False):
        backbone = cls(**kwargs)
    # Keras would initialize these at the next stateful scope exit; they never will be.
    global_state.set_global_attribute("uninitialized_variables", before)
    return backbone


def h5_locations(layer) -> dict:
    """{variable path: dataset path in `layer.save_weights(...)`'s .h5 file}.

    Keras names the file's groups by the object graph (attribute names and class
    names), not by variable paths; its own saver computes them, so ask it with a store
    that records instead of writing.
    """
    try:
        from keras.src.saving import saving_lib
        _save_state, store_cls = saving_lib._save_state, saving_lib.H5IOStore
    except (ImportError, AttributeError):
        raise _missing("keras.src.saving.saving_lib._save_state / H5IOStore") from None

    class _Entry(dict):
        def __init__(self, owner, path):
            super().__init__()
            self.owner, self.path = owner, path

        def __setitem__(self, key, value):
            group = f"{self.path}/vars" if self.path else "vars"
            self.owner.found[value.path] = f"{group}/{key}"

    class _Recorder(store_cls):
        def __init__(self):  # no file: nothing is written
            self.found = {}

        def __bool__(self):  # H5IOStore asks its (absent) file
            return True

        def make(self, path, metadata=None):
            return _Entry(self, path)

    recorder = _Recorder()
    _save_state(layer, weights_store=recorder, assets_store=None, inner_path="",
                visited_saveables=set())
    return recorder.found


def recording_safetensor_loader(preset: str):
    """A keras-hub `SafetensorLoader` whose `port_weight` records (key, hook, shape) per
    variable path in `.ported` instead of assigning."""
    try:
        from keras_hub.src.utils.transformers.safetensor_utils import SafetensorLoader
    except ImportError:
        raise _missing("keras_hub.src.utils.transformers.safetensor_utils") from None

    class RecordingSafetensorLoader(SafetensorLoader):
        def __init__(self, preset):
            super().__init__(preset)
            self.ported = {}

        def port_weight(self, keras_variable, hf_weight_key, hook_fn=None):
            self.ported[keras_variable.path] = (hf_weight_key, hook_fn,
                                                tuple(int(n) for n in keras_variable.shape))

    return RecordingSafetensorLoader(preset)

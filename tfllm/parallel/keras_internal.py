"""The private Keras 3 APIs of tfllm's Keras <-> DTensor bridge, fenced in one place.

Keras 3 cannot create a variable in a DTensor layout, so tfllm builds models without
allocating (a stateless scope), then hands each Keras variable a DVariable it created
itself. That needs four internals, used nowhere else:

* `Variable._value`: None until the variable has a value (`is_allocated`);
* `Variable._initializer` and `Variable._initialize(value)`: adopt a backend variable
  instead of running the deferred initializer (`adopt`);
* `keras.src.backend.common.global_state`'s "uninitialized_variables" list: Keras would
  initialize the deferred variables again at the next `build` (`forget_deferred`).

One more, for loading files others made rather than for the bridge: Keras' `SafeModeScope`
(`safe_mode`), which keeps deserialization safe whatever the process switched on.

Written for Keras 3.5-3.x (tested with 3.15; setup.py bounds keras to <4 and, for the
deserialization advisories fixed up to 3.13.2, to >=3.13.2). `check_keras`
runs before the first use and names the range when the installed Keras is outside it or
lacks one of them, instead of an AttributeError in the middle of model placement.
"""

from __future__ import annotations

import keras

WRITTEN_FOR = (3, 5)  # through 3.x


def _version(text: str):
    parts = []
    for piece in text.split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def check_keras(version: str = None) -> None:
    """Raises RuntimeError naming the supported range when Keras is outside it."""
    version = version or keras.__version__
    major_minor = _version(version)
    if major_minor[0] != WRITTEN_FOR[0] or major_minor < WRITTEN_FOR:
        raise RuntimeError(f"Keras {version} is not supported: tfllm's DTensor bridge uses "
                           f"Keras internals written for Keras {WRITTEN_FOR[0]}."
                           f"{WRITTEN_FOR[1]}-{WRITTEN_FOR[0]}.x; install "
                           f"'keras>={WRITTEN_FOR[0]}.{WRITTEN_FOR[1]},<{WRITTEN_FOR[0] + 1}'.")
    for name in ("_initialize",):
        if not hasattr(keras.Variable, name):
            raise RuntimeError(f"Keras {version} lacks Variable.{name}, which tfllm's DTensor "
                               f"bridge uses (written for Keras 3.5-3.x).")


def is_allocated(var) -> bool:
    """Whether the Keras variable already holds a value."""
    return getattr(var, "_value", None) is not None


def adopt(var, backend_variable) -> None:
    """Makes `backend_variable` (a tf.Variable or DVariable) the Keras variable's value."""
    var._initializer = None
    var._initialize(backend_variable)


def forget_deferred(done) -> None:
    """Removes `done` from Keras' list of variables awaiting deferred initialization."""
    try:
        from keras.src.backend.common import global_state
    except ImportError:
        raise RuntimeError(f"Keras {keras.__version__} lacks "
                           "keras.src.backend.common.global_state, which tfllm's DTensor "
                           "bridge uses (written for Keras 3.5-3.x).") from None
    pending = global_state.get_global_attribute("uninitialized_variables") or []
    ids = {id(v) for v in done}
    global_state.set_global_attribute("uninitialized_variables",
                                      [v for v in pending if id(v) not in ids])


def safe_mode():
    """A scope in which Keras deserializes in its default safe mode (no Python lambdas, no
    file paths in a config) even after `keras.config.enable_unsafe_deserialization()` in
    this process, which otherwise overrides even an explicit `safe_mode=True`.

    keras-hub's `Tokenizer.from_preset` takes no `safe_mode` (its kwargs become the
    tokenizer's constructor arguments); it deserializes the preset's tokenizer.json with
    Keras' default, then loads the preset's own vocabulary files (fixed names inside the
    preset) outside safe mode. So the scope resets the process-wide switch to "not set"
    (`SafeModeScope(None)`), not to True: True would also refuse those files.
    """
    try:
        from keras.src.saving.serialization_lib import SafeModeScope
    except ImportError:
        raise RuntimeError(f"Keras {keras.__version__} lacks keras.src.saving.serialization_lib"
                           ".SafeModeScope, which tfllm uses to load presets in safe mode "
                           "(written for Keras 3.5-3.x).") from None
    return SafeModeScope(None)

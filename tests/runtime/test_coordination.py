"""Agreement between clients, with the coordination service's key-value store faked."""

import pytest

from tfllm.runtime import coordination
from tfllm.runtime.coordination import ClientMismatchError, check_same_devices


class _Store:
    def __init__(self, **values):
        self.values = dict(values)

    def set_config_key_value(self, key, value):
        self.values[key] = value

    def get_config_key_value(self, key):
        return self.values[key]


def _as_client(monkeypatch, client, store):
    monkeypatch.setattr(coordination, "num_clients", lambda: 2)
    monkeypatch.setattr(coordination, "client_id", lambda: client)
    monkeypatch.setattr(coordination.internals, "eager_context", lambda: store)


def test_a_client_that_fell_back_to_the_cpu_stops_with_one_line(monkeypatch):
    store = _Store(**{"tfllm/devices/0": "GPU:8"})
    _as_client(monkeypatch, 1, store)
    with pytest.raises(ClientMismatchError, match="client 0 has 8 GPU.*client 1 has 1 CPU"
                                                  ".*tfllm doctor"):
        check_same_devices("CPU", 1)
    check_same_devices("GPU", 8)  # the same devices: no error
    assert store.values["tfllm/devices/1"] == "GPU:8"

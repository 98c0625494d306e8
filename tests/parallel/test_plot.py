"""`tfllm layouts --plot`: the blocks drawn are the blocks DTensor places."""

import pytest

from tfllm.cli.main import main
from tfllm.parallel.mesh import build_mesh
from tfllm.parallel.placement import local_blocks
from tfllm.parallel.plot import device_blocks


def _device_id(device):
    return int(device.rsplit(":", 1)[1])


@pytest.mark.parametrize("axes,shape,spec", [
    ("data=2,fsdp=2,model=2", (64, 8, 8), ("fsdp", "model", None)),
    ("data=2,fsdp=2,model=2", (128, 64), ("model", "fsdp")),
    ("fsdp=4,model=2", (16, 64), ("fsdp", None)),
    ("data=8", (64, 256), (None, None)),
])
def test_drawn_blocks_equal_the_shards_dtensor_places(axes, shape, spec):
    mesh = build_mesh(axes, "CPU", 8)
    placed = {}
    for device, start, size in local_blocks(mesh, shape, spec):
        placed.setdefault((tuple(start), tuple(size)), []).append(_device_id(device))
    mesh_shape = {n: mesh.dim_size(n) for n in mesh.dim_names}
    assert device_blocks(shape, spec, mesh_shape) == placed


def test_layouts_plot_writes_the_picture(tmp_path, capsys):
    import matplotlib
    import matplotlib.pyplot as plt
    backend, before = matplotlib.get_backend(), plt.get_fignums()
    out = tmp_path / "layouts.png"
    assert main(["layouts", "--config", "configs/tiny.yaml", "--set", "model.family=llama",
                 "--set", "mesh.axes=fsdp=4,model=2", "--plot", str(out)]) == 0
    assert f"picture: {out}" in capsys.readouterr().out
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    # The caller's matplotlib is left alone: same backend, no figure added to pyplot.
    assert matplotlib.get_backend() == backend and plt.get_fignums() == before

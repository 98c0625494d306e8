"""Process settings for GPU runs and compile caches: what is set, and that users' win."""

from tfllm.runtime import environment


def test_gpu_memory_leaves_a_reserve_and_keeps_the_users_settings():
    env = {}
    assert environment.gpu_memory(4096, "bfc", env) == {"TF_DEVICE_MIN_SYS_MEMORY_IN_MB": "4096"}
    assert "TF_GPU_ALLOCATOR" not in env  # bfc is TensorFlow's default: nothing to set
    env = {"TF_DEVICE_MIN_SYS_MEMORY_IN_MB": "1000"}
    assert environment.gpu_memory(4096, "cuda_malloc_async", env) == {
        "TF_GPU_ALLOCATOR": "cuda_malloc_async"}
    assert env["TF_DEVICE_MIN_SYS_MEMORY_IN_MB"] == "1000"


def test_xla_cache_directory_per_client(tmp_path):
    work = str(tmp_path / "run")
    assert environment.xla_cache_dir("auto", work, 3) == f"{work}/xla_cache/client_3"
    assert environment.xla_cache_dir("auto", None) is None  # no run directory (bench)
    assert environment.xla_cache_dir("off", work) is None
    # `--set train.xla_cache=off` reaches the config as YAML's boolean: "false", which
    # once made a folder named false in the current directory
    from tfllm.config import load_config
    setting = load_config(None, ["train.xla_cache=off"]).train.xla_cache
    assert environment.xla_cache_dir(setting, work) is None
    assert environment.xla_cache_dir("/shared/cache", work) == "/shared/cache"


def test_xla_cache_flags_are_added_once_and_never_replace_the_users(tmp_path):
    env = {"TF_XLA_FLAGS": "--tf_xla_auto_jit=0"}
    environment.xla_cache(str(tmp_path / "c"), env)
    assert env["TF_XLA_FLAGS"] == (f"--tf_xla_auto_jit=0 --tf_xla_persistent_cache_directory="
                                   f"{tmp_path / 'c'}")
    assert env["XLA_FLAGS"] == f"--xla_gpu_per_fusion_autotune_cache_dir={tmp_path / 'c'}/autotune"
    assert (tmp_path / "c" / "autotune").is_dir()
    assert environment.xla_cache(str(tmp_path / "other"), env) == {}  # already set: kept
    assert str(tmp_path / "other") not in env["TF_XLA_FLAGS"]
    assert environment.xla_cache(None, env) == {}


def test_traced_cpu_allocations_picks_tensorflows_bfc_unless_the_user_chose():
    env = {}
    assert environment.traced_cpu_allocations(env) == {"TF_CPU_ALLOCATOR_USE_BFC": "true"}
    env = {"TF_CPU_ALLOCATOR_USE_BFC": "false"}
    assert environment.traced_cpu_allocations(env) == {}
    assert env["TF_CPU_ALLOCATOR_USE_BFC"] == "false"

"""The cluster templates under launch/ keep CUDA's JIT cache: without it every cold start
JIT-compiles TensorFlow's Hopper PTX again (minutes), and `tfllm doctor` warns."""

import os
import re
import subprocess

import yaml

from tests.launch.helpers import ROOT

# The driver caps its JIT cache at 4 GiB; TensorFlow's PTX needs that much to stay cached.
CACHE_BYTES = 4 << 30


def test_slurm_template_keeps_the_jit_cache(tmp_path):
    path = os.path.join(ROOT, "launch", "slurm.sbatch")
    text = open(path).read()
    # Evaluate the template's own export lines in bash, as sbatch would (HOME given).
    exports = "\n".join(re.findall(r"^export CUDA_CACHE_\w+=.*$", text, re.M))
    script = exports + '\necho "$CUDA_CACHE_PATH $CUDA_CACHE_MAXSIZE"'
    out = subprocess.run(["bash", "-euc", script], capture_output=True, text=True, timeout=30,
                         env={"HOME": str(tmp_path), "PATH": os.environ["PATH"]}).stdout.split()
    assert out[0].startswith(str(tmp_path))  # per user, outlives the job
    assert int(out[1]) >= CACHE_BYTES
    assert subprocess.run(["bash", "-n", path], timeout=30).returncode == 0


def test_kubernetes_template_keeps_the_jit_cache():
    docs = list(yaml.safe_load_all(open(os.path.join(ROOT, "launch", "k8s-indexed-job.yaml"))))
    (job,) = [d for d in docs if d["kind"] == "Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert int(env["CUDA_CACHE_MAXSIZE"]) >= CACHE_BYTES
    # On a mounted volume: a pod's own disk dies with the pod.
    mounts = [m["mountPath"] for m in container["volumeMounts"]]
    assert any(env["CUDA_CACHE_PATH"].startswith(m + "/") for m in mounts), mounts


def test_kubernetes_template_admits_only_the_jobs_own_pods():
    # The workers' gRPC and NCCL ports are unauthenticated: a NetworkPolicy fences them.
    docs = list(yaml.safe_load_all(open(os.path.join(ROOT, "launch", "k8s-indexed-job.yaml"))))
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    (service,) = [d for d in docs if d["kind"] == "Service"]
    pods = service["spec"]["selector"]  # the Job's pods (Kubernetes labels them job-name)
    assert policy["spec"]["podSelector"] == {"matchLabels": pods}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert policy["spec"]["ingress"] == [{"from": [{"podSelector": {"matchLabels": pods}}]}]

"""Multi-host layouts from cluster managers (tfpod.cluster): SLURM's and Kubernetes' environments,
and the Kubernetes manifests validated against the Kubernetes schema (kubernetes-validate)."""

import copy
import os

import pytest
import yaml

from conftest import ROOT

from tfpod import UserError, cluster

pytestmark = pytest.mark.unit


def test_slurm_node_lists_and_tasks_per_node_expand():
    assert cluster.expand_nodelist("node[01-04,07],gpu5") == ["node01", "node02", "node03", "node04", "node07", "gpu5"]
    assert cluster.expand_nodelist("x[08-10]") == ["x08", "x09", "x10"]
    assert cluster.expand_nodelist("r[1-2]n[1-2]") == ["r1n1", "r1n2", "r2n1", "r2n2"]
    assert cluster.expand_nodelist("a,b") == ["a", "b"]
    assert cluster.expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    for bad in ("node[01-04", "node[a-b]"):
        with pytest.raises(UserError, match="SLURM node list"):
            cluster.expand_nodelist(bad)
    with pytest.raises(UserError, match="tasks per node"):
        cluster.expand_tasks_per_node("2(3)")


def slurm_env(**extra):
    return {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "node[1-2]",
            "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "TFPOD_PORT": "9000", **extra}


def test_slurm_gives_hosts_addresses_ports_and_gpus():
    layout = cluster.from_environment(slurm_env())
    assert (layout.host_id, layout.num_hosts, layout.source) == (3, 4, "slurm")
    assert layout.addresses == ("node1:9000", "node1:9001", "node2:9000", "node2:9001")
    assert layout.visible_gpus == "1"  # two tasks per node: SLURM_LOCALID 1 takes GPU 1
    assert cluster.from_slurm(slurm_env(TFPOD_GPUS_PER_TASK="4")).visible_gpus == "4,5,6,7"
    assert cluster.from_slurm(slurm_env(CUDA_VISIBLE_DEVICES="3")).visible_gpus is None  # SLURM's own binding wins
    one_per_node = cluster.from_slurm(slurm_env(SLURM_PROCID="1", SLURM_NTASKS="2", SLURM_STEP_TASKS_PER_NODE="1(x2)"))
    assert one_per_node.addresses == ("node1:9000", "node2:9000") and one_per_node.visible_gpus is None
    job_level = {k: v for k, v in slurm_env().items() if not k.startswith("SLURM_STEP")}
    job_level.update(SLURM_JOB_NODELIST="node[1-2]", SLURM_TASKS_PER_NODE="2(x2)")
    assert cluster.from_slurm(job_level).addresses == layout.addresses


def test_slurm_and_kubernetes_mistakes_are_one_line():
    with pytest.raises(UserError, match="do not make SLURM_NTASKS=4"):
        cluster.from_slurm(slurm_env(SLURM_STEP_TASKS_PER_NODE="1(x2)"))
    with pytest.raises(UserError, match="TFPOD_PORT='x'"):
        cluster.from_slurm(slurm_env(TFPOD_PORT="x"))
    with pytest.raises(UserError, match="TFPOD_NUM_HOSTS, TFPOD_SERVICE"):
        cluster.from_environment({"JOB_COMPLETION_INDEX": "0"})
    with pytest.raises(UserError, match="not in \\[0, TFPOD_NUM_HOSTS=2\\)"):
        cluster.from_kubernetes({"JOB_COMPLETION_INDEX": "2", "TFPOD_NUM_HOSTS": "2", "TFPOD_SERVICE": "s",
                                 "TFPOD_HOST_PREFIX": "p-"})


def test_no_cluster_or_dtensor_already_set_means_nothing_is_derived():
    assert cluster.from_environment({}) is None
    assert cluster.from_environment({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}) is None  # one task: one host
    assert cluster.from_environment({**slurm_env(), "DTENSOR_CLIENT_ID": "0"}) is None  # tfpod.launch / flags win


def test_apply_sets_dtensors_variables(monkeypatch):
    for k in ("DTENSOR_CLIENT_ID", "DTENSOR_NUM_CLIENTS", "DTENSOR_JOBS", "DTENSOR_JOB_NAME", "CUDA_VISIBLE_DEVICES"):
        # set, then unset: monkeypatch restores each variable as it was (unset) after the test; delenv
        # of an unset variable alone restores nothing, and cluster.apply's values stayed in this process
        # (its later main.py subprocesses waited for hosts node1 and node2 until their timeout)
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    cluster.apply(cluster.from_slurm(slurm_env()))
    assert os.environ["DTENSOR_CLIENT_ID"] == "3" and os.environ["DTENSOR_NUM_CLIENTS"] == "4"
    assert os.environ["DTENSOR_JOBS"] == "node1:9000,node1:9001,node2:9000,node2:9001"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1" and os.environ["DTENSOR_JOB_NAME"] == "worker"


def manifests(name):
    with open(os.path.join(ROOT, "deploy", "kubernetes", name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def pod_env(pod_spec):
    return {e["name"]: e["value"] for e in pod_spec["containers"][0]["env"]}


@pytest.mark.parametrize("index", [0, 3])
def test_the_indexed_job_manifest_maps_pods_to_hosts(index):
    service, job = manifests("indexed-job.yaml")
    pod = job["spec"]["template"]["spec"]
    env = {**pod_env(pod), "JOB_COMPLETION_INDEX": str(index)}
    layout = cluster.from_environment(env)
    hosts = job["spec"]["completions"]
    assert job["spec"]["parallelism"] == hosts == layout.num_hosts and layout.host_id == index
    # each pod's DNS name under the headless Service: <job name>-<index>.<subdomain>
    names = [f"{job['metadata']['name']}-{i}.{pod['subdomain']}:{service['spec']['ports'][0]['port']}"
             for i in range(hosts)]
    assert list(layout.addresses) == names
    assert pod["subdomain"] == service["metadata"]["name"] and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == job["spec"]["template"]["metadata"]["labels"]


def test_the_jobset_manifest_maps_pods_to_hosts():
    (jobset,) = manifests("jobset.yaml")
    replicated = jobset["spec"]["replicatedJobs"][0]
    job = replicated["template"]["spec"]
    env = {**pod_env(job["template"]["spec"]), "JOB_COMPLETION_INDEX": "2"}
    layout = cluster.from_environment(env)
    # JobSet names pods <jobset>-<replicatedJob>-<job index>-<pod index> under a Service named after the JobSet
    prefix = f"{jobset['metadata']['name']}-{replicated['name']}-0-"
    assert layout.addresses[2] == f"{prefix}2.{jobset['metadata']['name']}:8476"
    assert layout.num_hosts == job["completions"] == job["parallelism"] and replicated["replicas"] == 1


def test_the_manifests_restart_every_host_three_times():
    """As tfpod.launch --max_restarts=3: a JobSet restarts all its pods when one fails (its
    Job's backoffLimit 0 fails the Job); an Indexed Job makes failed pods again, and one
    restart fails every host (the others' collectives fail), so its backoffLimit is hosts x 3."""
    _, job = manifests("indexed-job.yaml")
    assert job["spec"]["backoffLimit"] == 3 * job["spec"]["completions"]
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "Never"
    (jobset,) = manifests("jobset.yaml")
    inner = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 3 and inner["backoffLimit"] == 0
    assert inner["template"]["spec"]["restartPolicy"] == "Never"


def test_manifests_validate_against_the_kubernetes_schema():
    import kubernetes_validate as kv

    docs = manifests("indexed-job.yaml")
    (jobset,) = manifests("jobset.yaml")
    # JobSet is a custom resource: its Job template is validated as the Job it becomes
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "tfpod-workers-0"},
           "spec": copy.deepcopy(jobset["spec"]["replicatedJobs"][0]["template"]["spec"])}
    for doc in docs + [job]:
        kv.validate(doc, "1.32.0", strict=True)
    broken = copy.deepcopy(docs[1])
    broken["spec"]["completions"] = "four"
    with pytest.raises(kv.ValidationError):
        kv.validate(broken, "1.32.0", strict=True)

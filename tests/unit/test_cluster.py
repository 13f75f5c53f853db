"""Cluster detection (duoka/launch/cluster.py) from the environments Slurm, a Kubernetes Indexed Job
and Kubeflow's PyTorchJob set, explicit flags winning; Slurm's host list syntax; the sbatch
script `duoka train --slurm-script` writes. The environments carry no PATH, so no scontrol:
the host lists go through duoka's parser (tests/integration/test_slurm.py holds it against
the real scontrol)."""

import shlex
from pathlib import Path

import pytest

from duoka.errors import DuokaError
from duoka.launch.cluster import SLURM_WARNING_S, expand_hostlist, resolve_launch
from duoka.launch.slurm_script import slurm_script
from duoka.launch.training import run_directory

# What srun sets for the task on the second of three nodes (Slurm 22.05, as printed by `env`
# in a step), less what detection does not read.
SLURM_STEP = {"SLURM_JOB_ID": "4711", "SLURM_JOB_NUM_NODES": "3", "SLURM_NNODES": "3", "SLURM_NODEID": "1",
              "SLURM_PROCID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_NODES": "3", "SLURM_STEP_NUM_TASKS": "3",
              "SLURM_STEP_NODELIST": "gpu[07-08],gpu10", "SLURM_JOB_NODELIST": "gpu[07-08],gpu10"}


def test_hostlist_expansion():
    assert expand_hostlist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_hostlist("node[8-10]") == ["node8", "node9", "node10"]  # the width is the lower bound's
    assert expand_hostlist("n[098-101]") == ["n098", "n099", "n100", "n101"]
    assert expand_hostlist("r[1-2]-n[1-2]") == ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]
    assert expand_hostlist("127.0.0.[1-2]") == ["127.0.0.1", "127.0.0.2"]
    assert expand_hostlist("single") == ["single"]
    assert expand_hostlist(" a , b[1] ") == ["a", "b1"]


@pytest.mark.parametrize("bad, why", [("gpu[01-03", "unbalanced"), ("gpu]1[", "unbalanced"),
                                      ("gpu[a-b]", "not a number"), ("gpu[5-3]", "runs backwards"),
                                      ("a[[1]]", "unbalanced"), (",", "no host")])
def test_hostlist_errors_name_the_list_and_the_fix(bad, why):
    with pytest.raises(DuokaError, match=why) as e:
        expand_hostlist(bad)
    assert repr(bad) in e.value.cause and "--rdzv-endpoint" in e.value.fix


def test_no_scheduler_keeps_the_single_node_defaults():
    launch = resolve_launch({"PATH": "/usr/bin", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234", "RANK": "0",
                             "JOB_COMPLETION_INDEX": "3"})
    assert (launch.nnodes, launch.node_rank, launch.rdzv_endpoint, launch.job_tag, launch.detected) == \
        (1, 0, None, None, None)
    given = resolve_launch({}, nnodes=0, node_rank=-1)
    assert (given.nnodes, given.node_rank) == (0, -1)  # passed on as given: the launcher refuses them, naming them


def test_slurm_step_gives_nodes_rank_endpoint_and_run_directory():
    launch = resolve_launch(SLURM_STEP)
    assert (launch.nnodes, launch.node_rank) == (3, 1)
    assert launch.rdzv_endpoint == "gpu07:30211"  # 29500 + 4711 % 1000 = 29500 + 711
    assert launch.nproc_per_node is None and launch.gpus is None  # the launcher counts the GPUs
    assert launch.job_tag == "slurm-4711"
    assert launch.detected == (
        "duoka: Slurm job 4711: node 1 of 3 (SLURM_NODEID, SLURM_STEP_NUM_NODES); rendezvous gpu07:30211 (first "
        "host of SLURM_STEP_NODELIST=gpu[07-08],gpu10, port from the job id); no GPU from Slurm; run directory "
        "runs/<model>-slurm-4711 unless job.output_dir is set")


def test_a_step_on_part_of_the_allocation_uses_the_steps_nodes():
    env = {**SLURM_STEP, "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_NODELIST": "gpu10,gpu08",
           "SLURM_NODEID": "0", "SLURM_RESTART_COUNT": "2"}
    launch = resolve_launch(env)
    assert (launch.nnodes, launch.node_rank, launch.rdzv_endpoint) == (2, 0, "gpu10:30211")
    assert launch.detected.startswith("duoka: Slurm job 4711 (restart 2): node 0 of 2")


def test_explicit_flags_win_over_slurm():
    launch = resolve_launch(SLURM_STEP, nnodes=2, node_rank=0, rdzv_endpoint="head:1234", nproc_per_node=4, gpus="0,1")
    assert (launch.nnodes, launch.node_rank, launch.rdzv_endpoint, launch.nproc_per_node, launch.gpus) == \
        (2, 0, "head:1234", 4, "0,1")
    assert "node " not in launch.detected and "rendezvous" not in launch.detected  # nothing of those was taken
    assert launch.job_tag == "slurm-4711"  # job.output_dir is the flag for that one


def test_slurm_gpus():
    visible = resolve_launch({**SLURM_STEP, "CUDA_VISIBLE_DEVICES": "0,1", "SLURM_GPUS_ON_NODE": "2",
                              "SLURM_STEP_GPUS": "4,5"})
    assert visible.gpus is None  # CUDA_VISIBLE_DEVICES is the launcher's, as always
    assert "GPUs 0,1 (CUDA_VISIBLE_DEVICES; SLURM_GPUS_ON_NODE=2)" in visible.detected
    listed = resolve_launch({**SLURM_STEP, "SLURM_STEP_GPUS": "4,5", "SLURM_JOB_GPUS": "4,5,6,7"})
    assert listed.gpus == "4,5" and "GPUs 4,5 (SLURM_STEP_GPUS)" in listed.detected
    batch = {k: v for k, v in SLURM_STEP.items() if not k.startswith("SLURM_STEP")} | {"SLURM_JOB_NUM_NODES": "1",
                                                                                     "SLURM_JOB_GPUS": "2"}
    assert resolve_launch(batch).gpus == "2"


def test_one_node_job_outside_srun_needs_no_rendezvous():
    env = {"SLURM_JOB_ID": "12", "SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "gpu[01"}
    launch = resolve_launch(env)  # the batch script of a one-node job: the host list is never read
    assert (launch.nnodes, launch.node_rank, launch.rdzv_endpoint, launch.job_tag) == (1, 0, None, "slurm-12")


def test_slurm_misuse_is_explained():
    with pytest.raises(DuokaError, match="srun started 6 tasks on 3 node") as e:
        resolve_launch({**SLURM_STEP, "SLURM_STEP_NUM_TASKS": "6"})
    assert "--ntasks-per-node=1" in e.value.fix
    outside = {k: v for k, v in SLURM_STEP.items() if not k.startswith("SLURM_STEP")}
    with pytest.raises(DuokaError, match="has 3 nodes .* started outside srun") as e:
        resolve_launch(outside)
    assert "srun --ntasks-per-node=1" in e.value.fix and "--slurm-script" in e.value.fix
    assert resolve_launch(outside, nnodes=1).nnodes == 1  # the flag says: this node alone
    with pytest.raises(DuokaError, match="SLURM_NODEID='x' is not a number"):
        resolve_launch({**SLURM_STEP, "SLURM_NODEID": "x"})
    with pytest.raises(DuokaError, match="cannot read the Slurm host list"):
        resolve_launch({**SLURM_STEP, "SLURM_STEP_NODELIST": "gpu[07-"})


def test_kubernetes_indexed_job():
    env = {"PET_NNODES": "4", "JOB_COMPLETION_INDEX": "2", "PET_RDZV_ENDPOINT": "duoka-train-0.duoka-train:29500",
           "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    launch = resolve_launch(env)
    assert (launch.nnodes, launch.node_rank, launch.rdzv_endpoint, launch.job_tag) == \
        (4, 2, "duoka-train-0.duoka-train:29500", None)
    assert launch.detected == ("duoka: Kubernetes Indexed Job: node 2 of 4 (JOB_COMPLETION_INDEX, PET_NNODES); "
                               "rendezvous duoka-train-0.duoka-train:29500 (PET_RDZV_ENDPOINT)")


def test_kubeflow_pytorchjob():
    # training-operator v1 (pytorch/envvar.go, master.go) for a worker pod, nprocPerNode "auto"
    env = {"MASTER_ADDR": "train-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "3", "RANK": "2",
           "PET_NPROC_PER_NODE": "auto", "PET_NODE_RANK": "2", "PET_NNODES": "3"}
    launch = resolve_launch(env)
    assert (launch.nnodes, launch.node_rank, launch.rdzv_endpoint, launch.nproc_per_node) == \
        (3, 2, "train-master-0:23456", None)
    assert launch.detected.startswith("duoka: Kubeflow PyTorchJob: node 2 of 3 (PET_NODE_RANK, PET_NNODES)")
    fixed = resolve_launch({**env, "PET_NPROC_PER_NODE": "8"})
    assert fixed.nproc_per_node == 8 and "8 process(es) per node (PET_NPROC_PER_NODE)" in fixed.detected


def test_torchrun_variables_misuse_is_explained():
    with pytest.raises(DuokaError, match="elastic range") as e:
        resolve_launch({"PET_NNODES": "1:4", "PET_NODE_RANK": "0", "PET_RDZV_ENDPOINT": "h:1"})
    assert "elasticPolicy" in e.value.fix
    with pytest.raises(DuokaError, match="this node's rank is not set"):
        resolve_launch({"PET_NNODES": "2", "PET_RDZV_ENDPOINT": "h:1"})
    with pytest.raises(DuokaError, match="no rendezvous endpoint") as e:
        resolve_launch({"PET_NNODES": "2", "JOB_COMPLETION_INDEX": "1"})
    assert "headless Service" in e.value.fix
    assert resolve_launch({"PET_NNODES": "2", "JOB_COMPLETION_INDEX": "1"}, rdzv_endpoint="h:1").node_rank == 1
    with pytest.raises(DuokaError, match="PET_NPROC_PER_NODE='cpu'"):
        resolve_launch({"PET_NNODES": "1", "PET_NPROC_PER_NODE": "cpu"})


def test_run_directory_per_job(tmp_path):
    from duoka.config import load_config

    cfg = load_config(None, ["--checkpoint.resume=auto"])
    assert run_directory(cfg, "slurm-4711") == Path("runs/debug-slurm-4711")  # resume=auto needs nothing more
    with pytest.raises(DuokaError, match="needs job.output_dir"):
        run_directory(cfg)
    cfg.job.output_dir = str(tmp_path)
    assert run_directory(cfg, "slurm-4711") == tmp_path


def test_slurm_script_content(tmp_path):
    command = ["/env/bin/duoka", "train", "/cfg/my run.toml", "--training.steps=10", "--checkpoint.resume=auto"]
    text = slurm_script(command, 4, 8, "duoka-x", tmp_path, ["--time=2:00:00", "--signal=B:USR1@600"], "duoka train")
    directives = [line.removeprefix("#SBATCH ") for line in text.splitlines() if line.startswith("#SBATCH ")]
    assert directives == ["--job-name=duoka-x", "--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=8", "--exclusive",
                          "--mem=0", "--requeue", f"--signal=B:USR1@{SLURM_WARNING_S}", "--open-mode=append",
                          f"--chdir={tmp_path}", "--time=2:00:00", "--signal=B:USR1@600"]  # the user's come last
    body = text.split("#SBATCH --signal=B:USR1@600\n", 1)[1]
    assert not any(line.startswith("#SBATCH") for line in body.splitlines())  # sbatch stops reading at a command
    srun = next(line for line in body.splitlines() if line.startswith("srun "))
    assert shlex.split(srun) == ["srun", "--cpus-per-task=$SLURM_CPUS_ON_NODE", *command, "&"]
    assert "trap 'warned=1; scancel --signal=TERM \"$SLURM_JOB_ID\"' USR1" in body
    assert 'if [ "$warned" = 1 ] && [ "$code" -ne 0 ]; then scontrol requeue "$SLURM_JOB_ID"; fi' in body
    cpu = slurm_script(command, 2, 0, "duoka-x", tmp_path, [], "duoka train")
    assert "--gpus-per-node" not in cpu and "#SBATCH --nodes=2" in cpu


def test_slurm_script_from_the_cli(in_process, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "cfg.toml"
    config.write_text("[training]\nsteps = 7\n")
    out = tmp_path / "jobs" / "train.sh"
    proc = in_process("train", "cfg.toml", "--nnodes=2", "--nproc-per-node=4", "--parallel.tp=2", "--max-restarts=1",
                      "--sbatch=--partition=gpu", "--slurm-script", str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"duoka: wrote {out}: 2 node(s) x 4 GPU(s)" in proc.stderr
    text = out.read_text()
    assert "#SBATCH --gpus-per-node=4" in text and "#SBATCH --partition=gpu" in text
    assert f"#SBATCH --chdir={tmp_path}" in text and out.stat().st_mode & 0o111
    srun = shlex.split(next(line for line in text.splitlines() if line.startswith("srun ")))
    assert srun[srun.index("train") + 1:] == [str(config), "--parallel.tp=2", "--checkpoint.resume=auto",
                                              "--max-restarts=1", "&"]


@pytest.mark.parametrize("args, message", [
    (["--checkpoint.resume=runs/a/checkpoints/step-5"], "every requeue would start again from that checkpoint"),
    (["--node-rank=1"], "--node-rank with --slurm-script"),
    (["--nproc-per-node=3", "--nnodes=1", "--parallel.tp=2"], "does not divide the 3 processes"),
    (["--training.stepz=3"], "stepz"),
])
def test_slurm_script_errors_come_at_once(in_process, tmp_path, args, message):
    out = tmp_path / "train.sh"
    proc = in_process("train", *args, "--slurm-script", str(out))
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not out.exists()


def test_sbatch_lines_need_the_script(in_process):
    proc = in_process("train", "--sbatch=--time=1:00:00")
    assert proc.returncode == 2 and "add --slurm-script FILE" in proc.stderr

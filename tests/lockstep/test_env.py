"""env: the launch environment of each launcher read into a World, and bad ones refused."""

from __future__ import annotations

import os

import pytest

import lockstep.env
from lockstep._cluster import DEFAULT_PORT, derived_port, expand_hostlist, expand_tasks_per_node, launch_defaults
from lockstep.env import World, WorldError, detect_world, first_slurm_host, read_settings, withhold_secret
from lockstep.errors import ConfigError


def test_nothing_set_is_one_process() -> None:
    world = detect_world({})
    assert world == World()
    assert (world.rank, world.world_size, world.local_rank, world.num_nodes) == (0, 1, 0, 1)
    assert world.is_main and not world.is_distributed
    assert world.source == "single" and world.master_port is None


def test_torchrun_variables() -> None:
    env = {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29400",
    }
    world = detect_world(env)
    assert (world.rank, world.local_rank, world.world_size, world.local_world_size) == (5, 1, 8, 4)
    assert (world.node_rank, world.num_nodes) == (1, 2)
    assert (world.master_addr, world.master_port) == ("10.0.0.1", 29400)
    assert world.source == "torchrun" and world.is_distributed and not world.is_main


def test_torchrun_defaults_and_spawn_source() -> None:
    world = detect_world({"RANK": "1", "WORLD_SIZE": "2", "LOCKSTEP_SOURCE": "spawn"})
    # RANK and WORLD_SIZE alone (Kubeflow's PyTorchJob: one process per pod): each rank is a node
    assert (world.local_rank, world.local_world_size, world.num_nodes, world.node_rank) == (0, 1, 2, 1)
    assert world.source == "spawn" and world.master_port is None


_SRUN = {"SLURM_STEP_ID": "0", "SLURM_JOB_ID": "4242"}  # what every task of srun has


def test_slurm_variables_and_nodelist() -> None:
    env = {
        **_SRUN,
        "SLURM_PROCID": "6",
        "SLURM_NTASKS": "8",
        "SLURM_LOCALID": "2",
        "SLURM_NODEID": "1",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_JOB_NODELIST": "gpu[003-005,010]",
    }
    world = detect_world(env)
    assert (world.rank, world.local_rank, world.world_size, world.local_world_size) == (6, 2, 8, 4)
    assert (world.node_rank, world.num_nodes, world.source) == (1, 2, "slurm")
    assert world.master_addr == "gpu003"
    assert world.master_port == 24242  # derived from SLURM_JOB_ID alike on every rank: no export needed


def test_slurm_master_port_override_and_single_task_step() -> None:
    env = {
        **_SRUN,
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "node07",
        "MASTER_PORT": "12345",
    }
    world = detect_world(env)
    assert (world.master_addr, world.master_port, world.local_world_size) == ("node07", 12345, 2)
    # An interactive allocation (one task) is not a distributed job.
    assert detect_world({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).source == "single"


@pytest.mark.parametrize(
    "nodelist, first",
    [
        ("gpu[003-005,010]", "gpu003"),
        ("node07", "node07"),
        ("cn[12,15-16],gpu01", "cn12"),
        ("a-b[7-9]", "a-b7"),
        ("host1,host2", "host1"),
        ("node[1-3]-ib", "node1-ib"),
        ("rack[0-1]_blade[0-1]", "rack0_blade0"),
    ],
)
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


def test_openmpi_variables() -> None:
    # OMPI_COMM_WORLD_NODE_RANK is the rank on its node (as mpirun sets it), not the node's index
    env = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_COMM_WORLD_NODE_RANK": "1",
        "MASTER_ADDR": "n0",
    }
    world = detect_world(env)
    assert (world.rank, world.local_rank, world.world_size, world.local_world_size) == (3, 1, 4, 2)
    assert (world.node_rank, world.num_nodes, world.source) == (1, 2, "openmpi")


@pytest.mark.parametrize("rank", range(8))
def test_openmpi_eight_ranks_four_per_node(rank: int) -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % 4),
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "OMPI_COMM_WORLD_NODE_RANK": str(rank % 4),
        "MASTER_ADDR": "n0",
        "MASTER_PORT": "29641",
    }
    world = detect_world(env)
    assert (world.node_rank, world.num_nodes, world.local_rank) == (rank // 4, 2, rank % 4)


def test_openmpi_one_node_needs_no_master_variables() -> None:
    """``mpirun -np 2 python -c "import lockstep; lockstep.Session()"`` as OpenMPI really sets it."""
    env = {
        "OMPI_COMM_WORLD_RANK": "1",
        "OMPI_COMM_WORLD_SIZE": "2",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_COMM_WORLD_NODE_RANK": "1",
        "OMPI_MCA_ess_base_jobid": "3172335617",
    }
    world = detect_world(env)
    assert (world.node_rank, world.num_nodes, world.master_addr) == (0, 1, "127.0.0.1")
    assert world.master_port == derived_port("3172335617")


def test_openmpi_across_nodes_without_master_addr_names_the_fix() -> None:
    env = {
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    }
    with pytest.raises(WorldError, match="MASTER_ADDR is not set.*mpirun -x MASTER_ADDR"):
        detect_world(env)


def test_mpich_and_intel_mpi_variables() -> None:
    world = detect_world({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"})
    assert (world.rank, world.world_size, world.local_rank, world.source) == (1, 2, 1, "mpich")
    assert world.master_port == DEFAULT_PORT


def test_horovodrun_variables() -> None:
    env = {
        "HOROVOD_RANK": "3",
        "HOROVOD_SIZE": "4",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1",
        "MASTER_ADDR": "h0",
    }
    world = detect_world(env)
    assert (world.rank, world.node_rank, world.num_nodes, world.source) == (3, 1, 2, "horovodrun")


def test_slurm_step_layout_wins_over_the_job_and_uneven_nodes() -> None:
    # job of 3 nodes; this step: 4 nodes' worth of tasks "2(x3),1" -> the last node runs 1 task
    env = {
        **_SRUN,
        "SLURM_PROCID": "6",
        "SLURM_NTASKS": "7",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "3",
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_NTASKS_PER_NODE": "3",
        "SLURM_STEP_NUM_NODES": "4",
        "SLURM_STEP_NUM_TASKS": "7",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
        "SLURM_STEP_NODELIST": "node[1-4]-ib",
        "SLURM_JOB_NODELIST": "other[1-3]",
    }
    world = detect_world(env)
    assert (world.num_nodes, world.local_world_size, world.master_addr) == (4, 1, "node1-ib")


def test_batch_script_outside_srun_is_one_process_with_a_warning() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-2]"}
    with pytest.warns(UserWarning, match="not started by srun"):
        world = detect_world(env)
    assert world.world_size == 1 and world.source == "single"
    with pytest.warns(UserWarning):
        assert detect_world({**env, "SLURM_STEP_ID": "4294967294"}).world_size == 1  # the batch step


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node[1-3]-ib", ["node1-ib", "node2-ib", "node3-ib"]),
        ("rack[0-1]_blade[0-1]", ["rack0_blade0", "rack0_blade1", "rack1_blade0", "rack1_blade1"]),
        ("gpu[008-010],cpu01", ["gpu008", "gpu009", "gpu010", "cpu01"]),
        ("a[1,3-4]b,c", ["a1b", "a3b", "a4b", "c"]),
    ],
)
def test_hostlist_expansion(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


def test_tasks_per_node_expansion() -> None:
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert expand_tasks_per_node("4") == [4]
    with pytest.raises(WorldError):
        expand_tasks_per_node("2(x)")


def test_launch_defaults_of_kubeflow_skypilot_and_slurm() -> None:
    assert launch_defaults(
        {
            "PET_NNODES": "2",
            "PET_NODE_RANK": "1",
            "PET_NPROC_PER_NODE": "4",
            "PET_MASTER_ADDR": "job-master-0",
            "PET_MASTER_PORT": "23456",
        }
    ) == {"nodes": 2, "node_rank": 1, "master": "job-master-0:23456", "nproc": 4}
    sky = launch_defaults(
        {
            "SKYPILOT_NODE_RANK": "1",
            "SKYPILOT_NODE_IPS": "10.1.0.5\n10.1.0.6\n",
            "SKYPILOT_NUM_NODES": "2",
            "SKYPILOT_NUM_GPUS_PER_NODE": "8",
            "MASTER_PORT": "29510",
        }
    )
    assert sky == {"nodes": 2, "node_rank": 1, "master": "10.1.0.5:29510", "nproc": 8}
    slurm = launch_defaults(
        {
            "SLURM_STEP_NUM_NODES": "2",
            "SLURM_STEP_NUM_TASKS": "2",
            "SLURM_NODEID": "1",
            "SLURM_STEP_NODELIST": "gpu[003-004]-ib",
            "SLURM_JOB_ID": "123",
        }
    )
    assert slurm == {"nodes": 2, "node_rank": 1, "master": "gpu003-ib:20123"}
    assert launch_defaults({}) == {}


def test_torchrun_variables_win_over_slurm() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}
    assert detect_world(env).source == "torchrun"


@pytest.mark.parametrize(
    "env, words",
    [
        ({"RANK": "2", "WORLD_SIZE": "2"}, ["rank 2", "world_size 2"]),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, ["rank -1"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, ["local_rank 2"]),
        ({"RANK": "zero", "WORLD_SIZE": "2"}, ["RANK", "'zero'", "not an integer"]),
        ({"RANK": "0", "WORLD_SIZE": "0"}, ["world_size must be >= 1"]),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, ["70000"]),
        ({**_SRUN, "SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, ["rank 4", "SLURM"]),
        ({"OMPI_COMM_WORLD_RANK": "0"}, ["OMPI_COMM_WORLD_SIZE", "required"]),
    ],
)
def test_inconsistent_environment_is_refused(env: dict[str, str], words: list[str]) -> None:
    with pytest.raises(WorldError) as info:
        detect_world(env)
    assert isinstance(info.value, ConfigError)
    for word in words:
        assert word in str(info.value)


def test_empty_slurm_nodelist_is_refused() -> None:
    with pytest.raises(WorldError, match="empty"):
        first_slurm_host("  ")


def test_a_withheld_secret_leaves_the_environment_and_stays_in_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lockstep.env, "_WITHHELD", {})
    monkeypatch.setenv("LOCKSTEP_SECRET", "s3cr3t")
    withhold_secret()
    assert "LOCKSTEP_SECRET" not in os.environ
    assert read_settings().secret == "s3cr3t"  # every later read, e.g. a second process group
    assert read_settings({}).secret == ""  # an explicit mapping is read alone
    withhold_secret()  # twice: nothing left to take, the secret is kept
    assert read_settings().secret == "s3cr3t"
    monkeypatch.setenv("LOCKSTEP_SECRET", "newer")  # set again: the environment's value is read
    assert read_settings().secret == "newer"

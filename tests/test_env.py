"""env: the launch environment of each launcher read into a World, and bad ones refused."""

from __future__ import annotations

import pytest

from lockstep.errors import ConfigError
from lockstep.env import World, WorldError, detect_world, first_slurm_host


def test_nothing_set_is_one_process() -> None:
    world = detect_world({})
    assert world == World()
    assert (world.rank, world.world_size, world.local_rank, world.num_nodes) == (0, 1, 0, 1)
    assert world.is_main and not world.is_distributed
    assert world.source == "single" and world.master_port is None


def test_torchrun_variables() -> None:
    env = {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
           "GROUP_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    world = detect_world(env)
    assert (world.rank, world.local_rank, world.world_size, world.local_world_size) == (5, 1, 8, 4)
    assert (world.node_rank, world.num_nodes) == (1, 2)
    assert (world.master_addr, world.master_port) == ("10.0.0.1", 29400)
    assert world.source == "torchrun" and world.is_distributed and not world.is_main


def test_torchrun_defaults_and_spawn_source() -> None:
    world = detect_world({"RANK": "1", "WORLD_SIZE": "2", "LOCKSTEP_SOURCE": "spawn"})
    assert (world.local_rank, world.local_world_size, world.num_nodes) == (0, 2, 1)
    assert world.source == "spawn" and world.master_port is None


def test_slurm_variables_and_nodelist() -> None:
    env = {"SLURM_PROCID": "6", "SLURM_NTASKS": "8", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "4",
           "SLURM_JOB_NODELIST": "gpu[003-005,010]"}
    world = detect_world(env)
    assert (world.rank, world.local_rank, world.world_size, world.local_world_size) == (6, 2, 8, 4)
    assert (world.node_rank, world.num_nodes, world.source) == (1, 2, "slurm")
    assert world.master_addr == "gpu003"


def test_slurm_master_port_override_and_single_task_step() -> None:
    env = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1",
           "SLURM_JOB_NODELIST": "node07", "MASTER_PORT": "12345"}
    world = detect_world(env)
    assert (world.master_addr, world.master_port, world.local_world_size) == ("node07", 12345, 2)
    # An interactive allocation (one task) is not a distributed job.
    assert detect_world({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).source == "single"


@pytest.mark.parametrize("nodelist, first", [
    ("gpu[003-005,010]", "gpu003"), ("node07", "node07"), ("cn[12,15-16],gpu01", "cn12"),
    ("a-b[7-9]", "a-b7"), ("host1,host2", "host1"),
])
def test_first_slurm_host(nodelist: str, first: str) -> None:
    assert first_slurm_host(nodelist) == first


def test_openmpi_variables() -> None:
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_NODE_RANK": "1"}
    world = detect_world(env)
    assert (world.rank, world.local_rank, world.world_size, world.local_world_size) == (3, 1, 4, 2)
    assert (world.node_rank, world.num_nodes, world.source) == (1, 2, "openmpi")


def test_torchrun_variables_win_over_slurm() -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}
    assert detect_world(env).source == "torchrun"


@pytest.mark.parametrize("env, words", [
    ({"RANK": "2", "WORLD_SIZE": "2"}, ["rank 2", "world_size 2"]),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, ["rank -1"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, ["local_rank 2"]),
    ({"RANK": "zero", "WORLD_SIZE": "2"}, ["RANK", "'zero'", "not an integer"]),
    ({"RANK": "0", "WORLD_SIZE": "0"}, ["world_size must be >= 1"]),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "70000"}, ["70000"]),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, ["rank 4", "SLURM"]),
    ({"OMPI_COMM_WORLD_RANK": "0"}, ["OMPI_COMM_WORLD_SIZE", "required"]),
])
def test_inconsistent_environment_is_refused(env: dict[str, str], words: list[str]) -> None:
    with pytest.raises(WorldError) as info:
        detect_world(env)
    assert isinstance(info.value, ConfigError)
    for word in words:
        assert word in str(info.value)


def test_empty_slurm_nodelist_is_refused() -> None:
    with pytest.raises(WorldError, match="empty"):
        first_slurm_host("  ")

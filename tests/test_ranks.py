import pytest

from stepscope.ranks import detect


def test_default_single_process():
    r = detect({})
    assert (r.rank, r.local_rank, r.world_size, r.source) == (0, 0, 1, "default")
    assert r.host


@pytest.mark.parametrize(
    "env, expected",
    [
        ({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}, (3, 1, 8, "torchrun")),
        ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_LOCAL_RANK": "2",
          "OMPI_COMM_WORLD_SIZE": "6"}, (5, 2, 6, "openmpi")),
        ({"PMI_RANK": "2", "PMI_SIZE": "4"}, (2, 0, 4, "pmi")),
        ({"SLURM_PROCID": "7", "SLURM_LOCALID": "3", "SLURM_NTASKS": "16"}, (7, 3, 16, "slurm")),
        # torchrun wins over a surrounding Slurm allocation
        ({"RANK": "1", "WORLD_SIZE": "2", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
         (1, 0, 2, "torchrun")),
    ],
)
def test_launchers(env, expected):
    r = detect(env)
    assert (r.rank, r.local_rank, r.world_size, r.source) == expected


def test_explicit_rank_wins():
    r = detect({"RANK": "3", "WORLD_SIZE": "8"}, rank=5)
    assert (r.rank, r.world_size, r.source) == (5, 8, "explicit")


def test_errors():
    with pytest.raises(ValueError, match="RANK='x' is not an integer"):
        detect({"RANK": "x"})
    with pytest.raises(ValueError, match="RANK=4 is not below WORLD_SIZE=4"):
        detect({"RANK": "4", "WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="rank must be an integer >= 0"):
        detect({}, rank=-1)
